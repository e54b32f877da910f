"""elastic-run end to end with real worker processes (the C++ test worker)."""
import os
import re
import signal
import socket
import time

import pytest

from helpers import Job, job_token_of, run, token_on_a_command_line, wait_gone


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


# A worker whose shell ignores SIGTERM and whose child does not: the child shows that the
# signal went to the whole group, the shell that only SIGKILL ends it.
STUBBORN = 'sleep 300 & echo "child $!"; trap "" TERM; while true; do sleep 0.2; done'


@pytest.mark.parametrize("how", ["grace", "second-signal"])
def test_sigterm_reaches_the_group_and_sigkill_follows(elastic_run, how):
    grace = "3" if how == "grace" else "300"
    job = Job([elastic_run, "-np", "2", "--grace-period", grace, "sh", "-c", STUBBORN])
    try:
        children = [int(m.group(1)) for m in job.wait_for(r"child (\d+)", count=2)]
        start = time.monotonic()
        os.kill(job.proc.pid, signal.SIGTERM)
        assert wait_gone(children, timeout=10) == [], job.text()  # the group got SIGTERM
        if how == "second-signal":
            time.sleep(0.5)
            assert job.proc.poll() is None, job.text()  # the shells ignore SIGTERM
            os.kill(job.proc.pid, signal.SIGINT)
        assert job.wait() == 128 + signal.SIGTERM, job.text()
        assert time.monotonic() - start < 60
        assert "SIGKILL after" in job.text()
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
    (["-np", "3", "--min-np", "3", "--max-np", "2"], 2, "above --max-np"),
    (["-np", "5", "--max-np", "4"], 2, "-np (5) is above --max-np (4)"),
    (["-np", "2", "--min-np", "3"], 2, "--min-np (3) is above -np (2)"),
    (["-np", "2", "--rendezvous-timeout", "0"], 2, "--rendezvous-timeout: must be above 0"),
    (["-np", "2", "--elastic-timeout", "-1"], 2, "--elastic-timeout: must be above 0"),
    (["-np", "2", "--reset-limit", "-1"], 2, "--reset-limit: must be 0 or more"),
    (["-np", "2", "--max-failures", "-2"], 2, "--max-failures: must be 0 or more"),
    (["-np", "2", "--grace-period", "-1"], 2, "--grace-period: must be 0 or more"),
    (["-np", "2", "-H", ""], 2, "the host list is empty"),
    (["--min-np", "1", "--host-discovery-script", "/no/such/discover.sh"], 2,
     "/no/such/discover.sh: No such file or directory"),
    (["-np", "1", "--output-dir", "/proc/no/such/dir"], 2, "--output-dir /proc/no/such/dir"),
    (["-np", "1", "--backend", "mpi"], 2, "--backend: mpi not in {auto,gloo,nccl}"),
])
def test_bad_cli_input_is_a_clear_error(elastic_run, test_worker, args, code, message):
    rc, out = run([elastic_run] + args + [test_worker, "collectives"], timeout=30)
    assert rc == code, out
    assert message in out


def test_a_port_in_use_is_a_clear_error(elastic_run, test_worker):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, out = run([elastic_run, "--port", str(port), "-np", "1", test_worker, "collectives"],
                      timeout=30)
    assert rc == 2, out
    assert f"--port {port}" in out and "in use" in out


def test_no_hosts_left_ends_the_job_at_once(elastic_run):
    # Static hosts and a permanent blacklist: nothing can come back, so no waiting.
    start = time.monotonic()
    rc, out = run([elastic_run, "-np", "2", "--min-np", "2", "-H", "localhost:2", "false"],
                  timeout=60)
    assert rc == 1, out
    assert "no hosts left" in out
    assert time.monotonic() - start < 50, out  # the --elastic-timeout is 600 s


def test_a_clean_exit_before_any_round_formed_after_failures_is_no_success(elastic_run):
    rc, out = run([elastic_run, "-np", "3", "--min-np", "1", "-H", "localhost:1,127.0.0.1:2",
                   "--blacklist-cooldown-range", "1", "8", "sh", "-c",
                   'case $ELASTIC_SLOT in 127.0.0.1:*) exit 1;; *) sleep 4;; esac'], timeout=60)
    assert rc == 1, out
    assert "success" not in out
    assert "exited 0 before round" in out
    # One incident per host: the host's two failed slots blacklist it once per round.
    cooldowns = re.findall(r"host 127\.0\.0\.1 is blacklisted for ([0-9.]+) s", out)
    assert 1 <= len(cooldowns) <= 4, out
    assert cooldowns[0] == min(cooldowns, key=float), out


def test_a_worker_with_a_slot_of_no_round_is_refused(elastic_run, test_worker):
    rc, out = run([elastic_run, "-np", "2", "sh", "-c",
                   f'[ $ELASTIC_SLOT = localhost:1 ] && export ELASTIC_SLOT=nowhere:9; '
                   f'exec {test_worker} collectives'], timeout=60)
    assert rc == 1, out
    assert "slot nowhere:9 is not a slot of this job" in out


def test_a_stray_copy_of_a_live_worker_is_refused(elastic_run, test_worker):
    # Slot localhost:1 starts a second process with the same environment (token, slot) but
    # another worker id: its Watch is refused at once and it exits 3, and the real one is
    # untouched by it.
    rc, out = run([elastic_run, "-np", "2", "sh", "-c",
                   f'if [ $ELASTIC_SLOT = localhost:1 ]; then '
                   f'ELASTIC_WORKER_ID=copy {test_worker} collectives; echo "copy exited $?"; fi; '
                   f'exec {test_worker} collectives'], timeout=60)
    assert "belongs to another process" in out, out
    assert "copy exited 3" in out, out
    assert rc == 0, out
    assert "[1]<stdout>:collectives ok rank 1 of 2" in out


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


def listening_addresses(port):
    # The addresses listening on `port` (IPv4, or IPv4-mapped IPv6 as gRPC binds them), as
    # dotted quads; "::" and other IPv6 addresses as their hex.
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if state != "0A" or int(p, 16) != port:
                    continue
                if len(addr) == 32 and addr.startswith("0000000000000000FFFF0000"):
                    addr = addr[24:]
                if len(addr) == 8:
                    out.append(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    out.append(addr)
    return out


def test_the_token_is_on_no_command_line_and_a_local_job_listens_on_loopback(
        elastic_run, test_worker):
    # The remote path (127.0.0.2 is not this host's name): the launcher's command line has
    # everything but the token, which comes on its stdin.
    job = Job([elastic_run, "-np", "2", "-H", "127.0.0.2:2", "--driver-address", "127.0.0.1",
               "--launcher-template", "sh -c {command}", test_worker, "sleep"])
    try:
        pids = [int(m.group(1)) for m in job.wait_for(r"sleeping pid (\d+)", count=2)]
        token = job_token_of(pids[0])
        assert token_on_a_command_line(token) == []
        port = int(re.search(r"rendezvous server on [0-9.]+:(\d+)", job.text()).group(1))
        assert listening_addresses(port) == ["127.0.0.1"], job.text()
    finally:
        job.kill()


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


def thread_nice_values(pid):
    """The nice value of every thread of a process (field 19 of /proc/PID/task/TID/stat)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            out.add(int(f.read().rsplit(")", 1)[1].split()[16]))
    return out


@pytest.mark.parametrize("setting", ["default", "off"])
def test_the_driver_runs_above_its_workers_where_it_may(elastic_run, test_worker, setting):
    if os.geteuid() != 0:
        pytest.skip("raising a priority needs root or CAP_SYS_NICE")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    env = dict(os.environ, ELASTIC_DRIVER_NICE="0") if setting == "off" else None
    job = Job([elastic_run, "-np", "2", test_worker, "sleep"], env=env)
    try:
        pids = [int(m.group(1)) for m in job.wait_for(r"sleeping pid (\d+)", count=2)]
        driver = thread_nice_values(job.proc.pid)
        expected = base if setting == "off" else max(base - 10, -20)
        # Every thread of the driver (gRPC's included), and none of the workers' threads.
        assert driver == {expected}, (driver, job.text())
        for pid in pids:
            assert thread_nice_values(pid) == {base}, job.text()
    finally:
        job.kill()
