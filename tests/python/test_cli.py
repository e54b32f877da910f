"""Every refusal of a bad command line (driver/main.cc and the driver's start): exit 2 and a
message that names what was wrong, before anything is started."""
import socket

import pytest

from helpers import run


@pytest.fixture
def files(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    not_executable = tmp_path / "plain.sh"
    not_executable.write_text("echo localhost:2\n")
    empty = tmp_path / "empty-hosts"
    empty.write_text("# nothing\n")
    bad = tmp_path / "bad-hosts"
    bad.write_text("host:zero\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return {"script": str(script), "plain": str(not_executable), "empty": str(empty),
            "bad": str(bad), "blocker": str(blocker), "tmp": str(tmp_path)}


CASES = [
    ([], "no worker command given"),
    (["--log-level", "loud"], "loud"),
    (["-np", "0"], "-np must be at least 1"),
    (["--min-np", "0"], "--min-np must be at least 1"),
    (["--max-np", "0"], "--max-np must be at least 1"),
    (["-H", "a:1", "--hostfile", "{empty}"], "give only one of -H, --hostfile"),
    (["-H", ""], "-H: the host list is empty"),
    (["--host-discovery-script", ""], "--host-discovery-script: no script given"),
    (["--host-discovery-script", "{plain}"], "give the path of an executable script"),
    (["-H", "a:zero"], "-H: "),
    (["--hostfile", "/no/such/hostfile"], "cannot read --hostfile"),
    (["--hostfile", "{bad}"], "--hostfile {bad}: "),
    (["--hostfile", "{empty}"], "lists no hosts"),
    (["-np", "2", "--spares", "1"], "--spares needs an elastic job"),
    (["--host-discovery-script", "{script}"], "nothing to run"),
    (["-np", "2", "--min-np", "3", "-H", "localhost:4"], "--min-np (3) is above -np (2)"),
    (["--min-np", "3", "--max-np", "2"], "--min-np (3) is above --max-np (2)"),
    (["-np", "3", "--max-np", "2"], "-np (3) is above --max-np (2)"),
    (["-np", "3", "-H", "localhost:2"], "-np 3 needs more slots than the 2"),
    (["--blacklist-cooldown-range", "5", "1"], "--blacklist-cooldown-range needs 0 <= MIN <= MAX"),
    (["--driver-address", "bad addr"], "a space is not allowed"),
    (["--launcher-template", "ssh {host}"], "has no {command}"),
    (["--liveness-timeout", "1"], "--liveness-timeout must be at least 1.5 s"),
    (["--discovery-interval", "0"], "--discovery-interval"),
    (["--backend", "mpi"], "--backend"),
    (["--port", "70000"], "--port"),
    (["--driver-timeout", "-1"], "--driver-timeout"),
    (["--driver-timeout", "soon"], "--driver-timeout"),
    (["--no-such-option"], "--no-such-option"),
    (["--output-dir", "{blocker}/sub"], "--output-dir"),
    (["--job-file", "{blocker}/sub/job.json"], "--job-file"),
    (["--straggler-factor", "1"], "--straggler-factor must be above 1 (or 0: off)"),
    (["--straggler-factor", "-2"], "--straggler-factor"),
    (["--straggler-window", "2"], "--straggler-window"),
    (["--straggler-action", "evict"], "--straggler-action"),
    (["-np", "2", "--straggler-action", "replace"], "--straggler-action replace needs an elastic"),
    (["-np", "2", "--straggler-action", "drop"], "--straggler-action drop needs an elastic"),
]


@pytest.mark.parametrize("args,says", CASES, ids=[" ".join(c[0]) or "none" for c in CASES])
def test_a_bad_command_line_exits_2_naming_the_problem(elastic_run, test_worker, files, args,
                                                        says):
    fill = lambda text: text.format(**files) if "{" in text and "{host" not in text and \
        "{command" not in text else text
    args = [fill(a) for a in args]
    command = [] if says == "no worker command given" else [test_worker, "collectives"]
    rc, out = run([elastic_run] + args + command, timeout=60)
    assert rc == 2, out
    assert fill(says) in out, out


def test_a_port_in_use_exits_2(elastic_run, test_worker):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out = run([elastic_run, "-np", "1", "--port", str(port), test_worker, "collectives"],
                      timeout=60)
    assert rc == 2, out
    assert f"--port {port}" in out, out


@pytest.mark.parametrize("content,says", [
    ("not json", "not a JSON object"),
    ('{"token": "abc"}', "no address"),
    ('{"address": "127.0.0.1:1"}', "no token"),
    ("x" * (70 << 10), "over 65536 bytes"),
])
def test_status_refuses_a_file_that_is_not_a_job_file(elastic_run, tmp_path, content, says):
    path = tmp_path / "job.json"
    path.write_text(content)
    rc, out = run([elastic_run, "status", "--job-file", str(path)], timeout=30)
    assert rc == 2, out
    assert "is not a job file" in out and says in out, out
