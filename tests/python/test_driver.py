"""elastic-run end to end with real worker processes (the C++ test worker)."""
import os
import re
import signal
import time

import pytest

from helpers import Job, run, wait_gone


@pytest.mark.parametrize("np", [1, 2, 4, 8])
def test_every_collective_as_processes(elastic_run, test_worker, np):
    rc, out = run([elastic_run, "-np", str(np), test_worker, "collectives"])
    assert rc == 0, out
    for r in range(np):
        assert f"[{r}]<stdout>:collectives ok rank {r} of {np}" in out
    assert "success" in out


def test_exit_code_of_the_first_failing_worker(elastic_run, test_worker):
    rc, out = run([elastic_run, "-np", "3", test_worker, "exit", "7", "1"])
    assert rc == 7, out
    assert re.search(r"worker 1 \(slot localhost:1, host localhost\) failed: exit status 7", out)


def test_worker_lost_in_a_collective_fails_every_peer(elastic_run, test_worker):
    # Elastic (--min-np), so the driver re-forms instead of stopping everyone.
    job = Job([elastic_run, "-np", "4", "--min-np", "1", test_worker, "lost"])
    try:
        victim = int(job.wait_for(r"victim pid (\d+)")[0].group(1))
        os.kill(victim, signal.SIGKILL)
        found = job.wait_for(r"lost detected rank (\d)", count=3, timeout=30)
        assert sorted(int(m.group(1)) for m in found) == [0, 1, 2]
        assert job.wait() == 0, job.text()
    finally:
        job.kill()


def test_sigterm_stops_every_worker_group(elastic_run, test_worker):
    job = Job([elastic_run, "-np", "3", "--grace-period", "2", test_worker, "sleep"])
    try:
        pids = [int(m.group(1)) for m in job.wait_for(r"sleeping pid (\d+)", count=3)]
        os.kill(job.proc.pid, signal.SIGTERM)
        assert job.wait() == 128 + signal.SIGTERM, job.text()
        assert wait_gone(pids) == []
        for pid in pids:  # each worker led its own process group; none is left
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)
    finally:
        job.kill()


def test_driver_crash_leaves_no_orphans(elastic_run, test_worker):
    job = Job([elastic_run, "-np", "2", test_worker, "sleep"])
    try:
        pids = [int(m.group(1)) for m in job.wait_for(r"sleeping pid (\d+)", count=2)]
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        assert wait_gone(pids) == []
    finally:
        job.kill()


def test_prefixed_output_never_interleaves(elastic_run, test_worker, tmp_path):
    lines = 3000
    rc, out = run([elastic_run, "-np", "2", "--output-dir", str(tmp_path), test_worker,
                   "print", str(lines)])
    assert rc == 0, out[-2000:]
    pad = "p" * 200
    rx = re.compile(r"^\[(\d)\]<(stdout|stderr)>:(line|err) (\d+) " + pad + " end$")
    counts = {}
    for line in out.splitlines():
        if line.startswith("["):
            if "]<" not in line:
                continue  # the driver's own log lines
            m = rx.match(line)
            assert m, f"mangled line: {line[:120]}"
            key = (m.group(1), m.group(2))
            counts[key] = counts.get(key, 0) + 1
    assert counts == {(r, s): lines for r in "01" for s in ("stdout", "stderr")}
    mirrored = (tmp_path / "localhost_1" / "stderr").read_text().splitlines()
    assert len(mirrored) == lines and mirrored[0].startswith("err 0 ")


@pytest.mark.parametrize("args,code,message", [
    (["-np", "0"], 2, "-np must be at least 1"),
    (["-np", "2", "-H", "bad host!:2"], 2, "not a valid host name"),
    (["-np", "2", "-H", "h1:x"], 2, "is not a number"),
    (["--no-such-flag", "-np", "2"], 2, "no-such-flag"),
    (["-np", "2", "--min-np", "3", "--max-np", "2"], 2, "above --max-np"),
])
def test_bad_cli_input_is_a_clear_error(elastic_run, test_worker, args, code, message):
    rc, out = run([elastic_run] + args + [test_worker, "collectives"], timeout=30)
    assert rc == code, out
    assert message in out


def test_a_command_that_does_not_exist(elastic_run):
    rc, out = run([elastic_run, "-np", "2", "/no/such/program"], timeout=30)
    assert rc == 127, out
    assert "command not found: /no/such/program" in out


def test_help_and_version(elastic_run):
    rc, out = run([elastic_run, "--help"], timeout=30)
    assert rc == 0 and "Examples:" in out and "--host-discovery-script" in out
    rc, out = run([elastic_run, "--version"], timeout=30)
    assert rc == 0 and out.startswith("elastic-run ")


def test_template_launcher_runs_remote_slots(elastic_run, test_worker, tmp_path):
    # 127.0.0.2 is not this host's name, so its slots go through the remote path: the command
    # line with cd, env and quoting that ssh or kubectl would run, here through plain sh.
    rc, out = run([elastic_run, "-np", "2", "-H", "127.0.0.2:2", "--driver-address", "127.0.0.1",
                   "--launcher-template", "sh -c {command}", test_worker, "collectives"])
    assert rc == 0, out
    assert "[1]<stdout>:collectives ok rank 1 of 2" in out


def test_a_peer_stopped_then_killed_mid_transfer_never_strands_a_survivor(elastic_run,
                                                                        test_worker):
    """Rank 1 is stopped while 64 MiB allreduces run, then killed: rank 0's collective ends
    with WorkerLostError (the pair fails, or the driver's ABORT ends it), it re-forms alone
    and the job succeeds, long before Gloo's 300 s collective timeout."""
    job = Job([elastic_run, "-np", "2", "--min-np", "1", test_worker, "big"])
    try:
        pid = int(job.wait_for(r"looping rank 1 pid (\d+)", timeout=60)[0].group(1))
        os.kill(pid, signal.SIGSTOP)
        time.sleep(1)  # set-up: let rank 0's sends fill the stopped peer's socket
        os.kill(pid, signal.SIGKILL)
        job.wait_for(r"lost detected rank 0", timeout=30)
        assert job.wait(timeout=60) == 0, job.text()
    finally:
        job.kill()
