"""Bugs found trying elastic-run as a new user would (issue 24), each pinned by a test that
fails without its fix: a template whose command holds "{command}", remote workers outliving a
killed driver, stack dumps that held up the driver's loop, a job whose every rank failed in
user code waiting for hosts, and bad arguments accepted or named wrongly."""
import os
import signal
import subprocess
import time
import uuid

import pytest

from helpers import (PY, WORKERS, Job, events, pid_alive, procs_with_marker, py_env, run,
                     wait_no_marker)


def marked_env(extra=None):
    marker = uuid.uuid4().hex
    env = dict(py_env(), ELASTIC_TEST_MARK=marker)
    env.update(extra or {})
    return marker, env


def test_a_command_holding_the_template_placeholder_starts(elastic_run):
    # The substitution used to re-expand its own output: the driver spun at 100 % CPU with
    # growing memory and never launched.
    rc, out = run([elastic_run, "-np", "1", "-H", "127.0.0.9:1", "--driver-address", "127.0.0.1",
                   "--launcher-template", "sh -c {command}", "echo", "{command} and {host}"],
                  timeout=60)
    assert rc == 0, out
    assert "[0]<stdout>:{command} and {host}" in out, out


@pytest.mark.parametrize("program", ["sleep", "ignores-term"])
def test_remote_workers_end_when_the_driver_is_killed(elastic_run, test_worker, program):
    # Programs that never connect to the driver (a fixed job of any program, or a Python
    # worker still importing torch): only the remote side of the launch can end them.
    marker, env = marked_env()
    argv = ([test_worker, "sleep"] if program == "sleep" else
            ["/bin/sh", "-c", "trap '' TERM; echo sleeping pid $$; while :; do sleep 1; done"])
    job = Job([elastic_run, "-np", "2", "-H", "127.0.0.2:2", "--driver-address", "127.0.0.1",
               "--launcher-template", "sh -c {command}", "--grace-period", "2"] + argv, env=env)
    try:
        job.wait_for(r"sleeping pid (\d+)", count=2, timeout=60)
        workers = procs_with_marker(marker)
        assert len(workers) >= 3, workers  # the driver, the launchers, the programs
    finally:
        job.kill()  # SIGKILL of the driver's whole process group
    left = wait_no_marker(marker, timeout=30)
    assert not left, [open(f"/proc/{p}/cmdline", "rb").read() for p in left if pid_alive(p)]


def test_a_driver_sigterm_ends_remote_workers_that_ignore_it(elastic_run):
    marker, env = marked_env()
    job = Job([elastic_run, "-np", "1", "-H", "127.0.0.2:1", "--driver-address", "127.0.0.1",
               "--launcher-template", "sh -c {command}", "--grace-period", "1", "/bin/sh", "-c",
               "trap '' TERM; echo sleeping pid $$; while :; do sleep 1; done"], env=env)
    try:
        job.wait_for(r"sleeping pid (\d+)", timeout=60)
        os.killpg(job.proc.pid, signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        job.kill()
    assert not wait_no_marker(marker, timeout=30)


def test_a_stack_dump_does_not_hold_up_the_driver(elastic_run, tmp_path):
    # eu-stack here waits until the test says so: while it runs, another worker is killed,
    # and the driver must see that exit (it used to dump on its event loop, for up to 15 s).
    fake = tmp_path / "bin"
    fake.mkdir()
    release, began = tmp_path / "release", tmp_path / "began"
    (fake / "eu-stack").write_text(f"""#!/bin/sh
echo "fake eu-stack for $2"
touch {began}
i=0
while [ ! -e {release} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
[ -e {release} ] && echo "fake eu-stack released" || echo "fake eu-stack gave up"
""")
    (fake / "eu-stack").chmod(0o755)
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    marker, env = marked_env({"PATH": f"{fake}:{os.environ['PATH']}"})
    job = Job([elastic_run, "-np", "3", "--min-np", "1", "--hang-timeout", "3",
               "--event-log", log, PY, os.path.join(WORKERS, "train_state.py"), "2000", book,
               "--hang-at", "20", "--hang-how", "stop"], env=env)
    try:
        job.wait_for(r"hanging pid (\d+)", timeout=120)
        deadline = time.monotonic() + 60
        while not began.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert began.exists(), job.text()
        started = {e["slot"]: e["pid"] for e in events(log) if e["event"] == "worker_started"}
        victim = started["localhost:1"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(e["event"] == "worker_exited" and e["slot"] == "localhost:1"
                   for e in events(log)):
                break
            time.sleep(0.1)
        seen = any(e["event"] == "worker_exited" and e["slot"] == "localhost:1"
                   for e in events(log))
        release.write_text("")
        assert seen, job.text()
        job.wait_for(r"fake eu-stack released", timeout=30)
        # The exit was seen while the dump ran (the driver's loop was free), not after it.
        order = [(e["event"], e.get("slot")) for e in events(log)
                 if e["event"] in ("worker_exited", "stacks_dumped")]
        assert order.index(("worker_exited", "localhost:1")) < order.index(
            ("stacks_dumped", "localhost:2")), order
        # The hung worker is killed after its dump, not before.
        hung = [e for e in events(log) if e["event"] == "worker_hung"]
        assert len(hung) == 1, hung
        deadline = time.monotonic() + 30
        while pid_alive(hung[0]["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(hung[0]["pid"])
        assert "fake eu-stack gave up" not in job.text()
    finally:
        release.write_text("")
        job.kill()
    assert not wait_no_marker(marker, timeout=30)


def test_every_rank_failing_at_one_step_ends_the_job_with_the_first_error(elastic_run,
                                                                          tmp_path):
    # Before, the job waited --elastic-timeout (600 s) for hosts; Horovod fails at once.
    log = str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--event-log", log, PY,
               os.path.join(WORKERS, "train_state.py"), "4", str(tmp_path / "l"),
               "--fail-all-at", "5"], env=py_env())
    try:
        rc = job.wait(timeout=120)
    finally:
        job.kill()
    out = job.text()
    assert rc == 1, out
    assert "every worker of round 0 (3 of them) failed in its own code" in out, out
    assert "ValueError: the same bug on every rank" in out, out
    assert [e for e in events(log) if e["event"] == "round_failed"], out
    assert not [e for e in events(log) if e["event"] == "waiting_for_hosts"], out


def test_every_worker_failing_before_it_connects_ends_the_job(elastic_run, tmp_path):
    # Found trying Horovod's MNIST example, which imports a module this machine lacked: every
    # worker exited 1 at its import, the host was blacklisted, and the job waited
    # --elastic-timeout (600 s) for hosts.
    log = str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "--min-np", "1", "--max-np", "2", "-H", "localhost:2",
               "--event-log", log, PY, "-c", "import no_such_module_here"], env=py_env())
    try:
        rc = job.wait(timeout=120)
    finally:
        job.kill()
    out = job.text()
    assert rc == 1, out
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in out, out
    assert "exited before it connected to the driver" in out, out
    assert [e for e in events(log) if e["event"] == "round_failed"], out


def test_every_rank_failing_is_retried_within_a_failure_budget(elastic_run, tmp_path):
    rc, out = run([elastic_run, "-np", "2", "--min-np", "2", "--max-failures", "1",
                   "--blacklist-cooldown-range", "0", "0.1", PY,
                   os.path.join(WORKERS, "train_state.py"), "4", str(tmp_path / "l"),
                   "--fail-all-at", "5"], env=py_env(), timeout=180)
    assert rc == 1, out
    assert "every worker of round" not in out, out
    assert "too many failures (--max-failures 1)" in out, out


@pytest.mark.parametrize("args,says", [
    (["--driver-address", "bad addr"], "--driver-address 'bad addr': a space is not allowed"),
    (["--driver-address", "head:29500"], "a port does not go here"),
    (["--min-np", "3", "--max-np", "2"], "--min-np (3) is above --max-np (2)"),
    (["-np", "3", "--max-np", "2"], "-np (3) is above --max-np (2)"),
    (["--launcher-template", "ssh {host}"], "has no {command}"),
])
def test_bad_arguments_exit_2_naming_what_the_user_gave(elastic_run, test_worker, args, says):
    rc, out = run([elastic_run] + args + [test_worker, "collectives"], timeout=30)
    assert rc == 2, out
    assert says in out, out


def dead_segments(before):
    """/dev/shm segments of ours (elastic-<pid>-<token>) made since `before` whose pid is gone."""
    out = []
    for name in set(os.listdir("/dev/shm")) - before:
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == "elastic" and parts[1].isdigit() and \
                not pid_alive(int(parts[1])):
            out.append(name)
    return out


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_worker_killed_before_its_segment_is_mapped_leaves_nothing_in_dev_shm(
        elastic_run, test_worker, tmp_path, where):
    # Found by the soak: the first rank of a host names its shared-memory segment until every
    # rank has mapped it; killed in between, the name stayed in /dev/shm for good.
    host = "localhost" if where == "local" else "127.0.0.2"
    hook = f"shm_made@{host}:0@0@*=kill"
    extra = [] if where == "local" else ["-H", "127.0.0.2:2", "--driver-address", "127.0.0.1",
                                         "--launcher-template", "sh -c {command}"]
    before = set(os.listdir("/dev/shm"))
    marker, env = marked_env({"ELASTIC_TEST_HOOKS": hook})
    rc, out = run([elastic_run, "-np", "2"] + extra + [test_worker, "collectives"], env=env,
                  timeout=120)
    assert rc != 0, out  # a fixed-size job ends at its first failure
    assert "signal 9" in out or "exit status 137" in out, out
    assert not wait_no_marker(marker, timeout=30)
    assert dead_segments(before) == [], out


def test_a_segment_whose_process_dies_after_the_driver_started_is_gone_when_the_job_ends(
        elastic_run, test_worker, tmp_path):
    """Found by the checkpoint soak (seed 895258539): a job killed whole, then started again at
    once; a worker killed while it made its host's segment was still dying when the new driver
    swept /dev/shm at its start, and its segment outlived the job. The driver sweeps again at
    the job's end. Here the owner is a process that lives when the driver starts and dies (and
    is reaped) before the job ends."""
    owner = subprocess.Popen(["sleep", "600"])
    segment = f"/dev/shm/elastic-{owner.pid}-beef"
    try:
        with open(segment, "w"):
            pass
        job = Job([elastic_run, "-np", "1", test_worker, "sleep"])
        try:
            job.wait_for(r"sleeping pid \d+", timeout=60)
            assert os.path.exists(segment)  # its owner lived at the driver's start
            owner.kill()
            owner.wait()
            os.kill(job.proc.pid, signal.SIGTERM)  # the job ends: its driver's end
            job.wait(timeout=60)
        finally:
            job.kill()
        assert not os.path.exists(segment), job.text()
    finally:
        owner.kill()
        owner.wait()
        if os.path.exists(segment):
            os.unlink(segment)


def test_a_worker_that_hangs_after_training_is_killed_and_the_job_ends(elastic_run, tmp_path):
    # Found by the namespace soak: a member that never exits after its peers finished (a hang
    # in teardown: a stuck DataLoader worker, a CUDA deinit) kept the job running for good.
    script = tmp_path / "hang_at_exit.py"
    script.write_text("""
import time
import numpy as np
import elastic

state = elastic.ObjectState(step=0)


@elastic.run
def train(state):
    while state.step < 20:
        elastic.allreduce(np.ones(4))
        state.step += 1
        state.commit()


train(state)
if elastic.rank() == 1:
    print("hanging after training", flush=True)
    time.sleep(3600)
""")
    log = str(tmp_path / "events.jsonl")
    marker, env = marked_env()
    job = Job([elastic_run, "-np", "2", "--hang-timeout", "3", "--event-log", log, PY,
               str(script)], env=env)
    try:
        rc = job.wait(timeout=120)
    finally:
        job.kill()
    out = job.text()
    assert rc == 0, out
    hung = [e for e in events(log) if e["event"] == "worker_hung"]
    assert len(hung) == 1 and "did not exit" in hung[0]["reason"], hung
    assert "a hang in its teardown" in hung[0]["reason"], hung
    assert not wait_no_marker(marker, timeout=30)


def test_a_round_that_changes_while_its_members_connect_is_left_at_once(elastic_run, build_dir,
                                                                       tmp_path):
    # Found by the namespace soak (30 s without a step): a round formed with a member cut off
    # from the others; the driver removed that member and fenced the round, but a fence waits
    # for a commit, and the others were still connecting to it. Here the member stops itself
    # while it connects round 0 and its slot is removed: round 1 must form while it is still
    # stopped (before the liveness timeout finds it), not after its process is gone.
    from helpers import Discovery, events, wait_event
    example = str(build_dir / "examples" / "logistic_regression")
    disc = Discovery(tmp_path, "localhost:3")
    log = str(tmp_path / "events.jsonl")
    marker, env = marked_env({"ELASTIC_TEST_HOOKS": "connect@localhost:2@0@*=stop",
                              # Pairs connect when the round forms, even on one host.
                              "ELASTIC_SHM_COLLECTIVES": "0", "ELASTIC_GLOO_LAZY_PAIRS": "0"})
    job = Job([elastic_run, "--min-np", "2", "--max-np", "3", "--host-discovery-script",
               str(disc.script), "--discovery-interval", "0.2", "--liveness-timeout", "60",
               "--event-log", log, example, "--epochs", "3"], env=env)
    try:
        job.wait_for(r"test hook connect fired: stop", timeout=60)
        disc.set("localhost:2")
        formed = wait_event(log, lambda e: e["event"] == "round_formed" and e["round"] >= 1,
                            timeout=40)
        assert formed is not None, job.text()
        exited = [e for e in events(log)
                  if e["event"] == "worker_exited" and e["slot"] == "localhost:2"]
        assert not exited, (exited, job.text())  # still stopped: nobody waited for it
        assert job.wait(timeout=120) == 0, job.text()
    finally:
        job.kill()
    assert not wait_no_marker(marker, timeout=30)
