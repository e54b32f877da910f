"""The job outlives its driver (issue 26, docs/recovery.md "When the driver is lost"): workers
that joined train on while the driver is gone, for up to --driver-timeout; then every one exits
by itself. Their output goes to files that outlive the driver, so nothing a worker writes
harms it. A program that never joined still dies with its driver. The oracles are the
workers' own ledgers and output files, and /proc (which processes carry the test's marker),
never the driver's account."""
import sys
import glob
import os
import signal
import time

import pytest

from helpers import Job, kill_driver, marked_env, wait_no_marker, wait_workers, workers
import ledger

TIMEOUT = 4  # --driver-timeout of these tests, in seconds
SLACK = 5    # the bound: every worker gone by the timeout + 5 s


def kill_driver_of_training(job, marker, n, pattern):
    """Once `pattern` is printed, SIGKILL of the driver of n training workers; 2 s later the
    same worker processes must still be there. Returns the time of the kill."""
    job.wait_for(pattern, timeout=90)
    pids = wait_workers(marker, n)
    killed_at = kill_driver(job)
    time.sleep(2)
    assert workers(marker) == pids
    return killed_at


def lines_after(prefix, t):
    """Ledger lines (steps started) per rank file, written after time t (seconds)."""
    out = {}
    for path in glob.glob(prefix + ".*"):
        out[path] = sum(1 for l in ledger.read_file(path) if l.ts > t * 1000)
    return out


def check_all_gone(marker, killed_at):
    left = wait_no_marker(marker, timeout=TIMEOUT + SLACK + 5)
    assert not left, f"workers outlived the driver's timeout: {left}"
    return time.time() - killed_at


def slot_files(root):
    return {os.path.basename(d): d for d in glob.glob(os.path.join(root, "*"))}


def test_cpp_workers_train_on_without_the_driver_then_exit_by_themselves(
        elastic_run, build_dir, tmp_path):
    marker = f"outage-cpp-{os.getpid()}"
    book = str(tmp_path / "ledger")
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    example = str(build_dir / "examples" / "logistic_regression")
    job = Job([elastic_run, "-np", "2", "--driver-timeout", str(TIMEOUT), example,
               "--epochs", "100000", "--step-ms", "5", "--ledger", book],
              env=marked_env(marker, XDG_RUNTIME_DIR=str(runtime)))
    try:
        killed_at = kill_driver_of_training(job, marker, 2, r"\[0\]<stdout>:epoch 1 done")
        # Still training: each rank's ledger has steps started after the kill, and later ones
        # (a step is only started once the one before it went through its allreduce).
        after = lines_after(book, killed_at + 0.2)
        assert len(after) == 2 and all(n >= 20 for n in after.values()), after
        took = check_all_gone(marker, killed_at)
        assert took >= TIMEOUT - 0.5, f"workers left {took:.1f} s after the kill"
    finally:
        job.kill()
        wait_no_marker(marker, timeout=15)
    # The output the workers wrote during the outage is kept where the driver said.
    spools = glob.glob(str(runtime / "elastic-run" / "*.output"))
    assert len(spools) == 1, spools
    assert f"worker output is kept in {spools[0]}" in job.text()
    slots = slot_files(spools[0])
    assert sorted(slots) == ["localhost_0", "localhost_1"], slots
    err0 = open(os.path.join(slots["localhost_0"], "stderr")).read()
    assert "lost the driver" in err0 and "training goes on without it" in err0, err0
    assert "unreachable for" in err0 and f"--driver-timeout {TIMEOUT} s" in err0, err0
    # Ended by elastic::Run (its message, then exit(3)), not by the agent's last resort.
    assert "\nelastic: the driver at " in err0 and "did not end within" not in err0, err0
    out0 = open(os.path.join(slots["localhost_0"], "stdout")).read()
    shown = sum(1 for l in job.lines if l.startswith("[0]<stdout>:epoch "))
    kept = sum(1 for l in out0.splitlines() if l.startswith("epoch "))
    assert kept > shown, (shown, kept)  # epochs finished while the driver was gone


def test_python_workers_print_through_a_driver_outage(elastic_run, tmp_path):
    """A Python print with its stdout's reader gone raises BrokenPipeError: the outputs are
    files, so the workers print on (and the lines are kept under --output-dir)."""
    marker = f"outage-py-{os.getpid()}"
    worker = os.path.join(os.path.dirname(__file__), "workers", "train_state.py")
    out = tmp_path / "out"
    job = Job([elastic_run, "-np", "2", "--driver-timeout", str(TIMEOUT), "--output-dir",
               str(out), sys.executable, worker, "100000", str(tmp_path / "ledger"),
               "--print-steps"], env=marked_env(marker))
    try:
        killed_at = kill_driver_of_training(job, marker, 2, r"\[1\]<stdout>:step 30 rank 1")
        check_all_gone(marker, killed_at)
    finally:
        job.kill()
        wait_no_marker(marker, timeout=15)
    for slot in ("localhost_0", "localhost_1"):
        text = (out / slot / "stdout").read_text()
        err = (out / slot / "stderr").read_text()
        assert "BrokenPipe" not in err and "Traceback" not in err, err
        assert "unreachable for" in err, err
        steps = [int(l.split()[1]) for l in text.splitlines() if l.startswith("step ")]
        shown = [int(l.split(":step ")[1].split()[0]) for l in job.lines
                 if l.startswith(f"[{slot[-1]}]<stdout>:step ")]
        # Printed while the driver was gone: many more steps than the driver showed.
        assert steps and max(steps) > max(shown) + 20, (max(steps), max(shown))


def test_a_peer_lost_during_the_outage_leaves_the_survivors_waiting_for_the_driver(
        elastic_run, build_dir, tmp_path):
    """A membership change needs the driver: the survivors of a peer killed while it is gone
    roll back, wait in Join, and exit by themselves at the timeout."""
    marker = f"outage-peer-{os.getpid()}"
    book = str(tmp_path / "ledger")
    out = tmp_path / "out"
    example = str(build_dir / "examples" / "logistic_regression")
    job = Job([elastic_run, "-np", "3", "--min-np", "1", "--driver-timeout", str(TIMEOUT),
               "--output-dir", str(out), example, "--epochs", "100000", "--step-ms", "5",
               "--ledger", book], env=marked_env(marker))
    try:
        job.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        wait_workers(marker, 3)
        killed_at = kill_driver(job)
        time.sleep(0.5)
        victim = workers(marker, "localhost:2")
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        time.sleep(1.5)
        assert len(workers(marker)) == 2  # the survivors wait
        # They stopped training: no step started in the last second.
        quiet = lines_after(book, time.time() - 1.0)
        assert sum(quiet.values()) == 0, quiet
        check_all_gone(marker, killed_at)
    finally:
        job.kill()
        wait_no_marker(marker, timeout=15)
    err = (out / "localhost_0" / "stderr").read_text()
    assert "rolling back to the last commit" in err, err
    assert "unreachable for" in err, err


@pytest.mark.parametrize("case", ["never-joined", "timeout-0"])
def test_workers_that_do_not_ride_out_die_with_their_driver(elastic_run, build_dir, case):
    """A program that never joined the job (here `sleep`, under a long timeout), and every
    worker under --driver-timeout 0: gone within seconds of the driver's SIGKILL."""
    marker = f"outage-{case}-{os.getpid()}"
    example = str(build_dir / "examples" / "logistic_regression")
    command = (["--driver-timeout", "600", "sleep", "600"] if case == "never-joined" else
               ["--driver-timeout", "0", example, "--epochs", "100000", "--step-ms", "5"])
    job = Job([elastic_run, "-np", "2"] + command, env=marked_env(marker))
    try:
        if case == "timeout-0":
            job.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        wait_workers(marker, 2)
        kill_driver(job)
        assert not wait_no_marker(marker, timeout=5)
    finally:
        job.kill()
        wait_no_marker(marker, timeout=15)


def test_a_job_that_ends_removes_its_output_spool(elastic_run, build_dir, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    example = str(build_dir / "examples" / "logistic_regression")
    job = Job([elastic_run, "-np", "2", example, "--epochs", "1"],
              env=marked_env("spool", XDG_RUNTIME_DIR=str(runtime)))
    assert job.wait(timeout=120) == 0, job.text()
    assert "[0]<stdout>:final: " in job.text()
    assert "worker output is kept in " in job.text()
    assert glob.glob(str(runtime / "elastic-run" / "*.output")) == []


def read_marks(prefix, rank):
    try:
        return open(f"{prefix}.{rank}").read().splitlines()
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("carry_on", [False, True], ids=["ends-its-own-way", "last-resort"])
def test_a_worker_whose_driver_is_gone_ends_through_the_program(elastic_run, tmp_path,
                                                                 carry_on):
    """Past --driver-timeout the agent ends the worker through the program, never behind its
    back: @elastic.run raises SystemExit(3) at the next collective or commit, and the program's
    finally blocks and atexit handlers run. A program that catches the SystemExit and goes on
    is ended by the agent's last resort (exit 3) 30 s later (AgentImpl::kEndGrace). The oracle
    is the program's own marks and /proc."""
    marker = f"outage-end-{int(carry_on)}-{os.getpid()}"
    worker = os.path.join(os.path.dirname(__file__), "workers", "driver_gone.py")
    marks = str(tmp_path / "marks")
    out = tmp_path / "out"
    job = Job([elastic_run, "-np", "2", "--driver-timeout", str(TIMEOUT), "--output-dir",
               str(out), sys.executable, worker, marks] + (["--carry-on"] if carry_on else []),
              env=marked_env(marker))
    grace = 30
    try:
        killed_at = kill_driver_of_training(job, marker, 2, r"\[1\]<stdout>:rank 1 trains")
        if carry_on:
            # Both said the end reached them and carry on; the last resort ends them.
            deadline = time.monotonic() + TIMEOUT + SLACK + 10
            while time.monotonic() < deadline and not all(
                    "carrying on" in read_marks(marks, r) for r in (0, 1)):
                time.sleep(0.1)
            assert workers(marker), "ended before the grace"
            left = wait_no_marker(marker, timeout=TIMEOUT + grace + SLACK + 5)
            assert not left, f"workers outlived the last resort: {left}"
        else:
            check_all_gone(marker, killed_at)
    finally:
        job.kill()
        wait_no_marker(marker, timeout=15)
    for rank in (0, 1):
        seen = read_marks(marks, rank)
        if carry_on:
            assert seen == ["SystemExit 3", "carrying on"], seen
        else:
            assert seen == ["SystemExit 3", "finally", "atexit"], seen
    err = (out / "localhost_0" / "stderr").read_text()
    assert "unreachable for" in err and "Traceback" not in err, err
    assert ("did not end within 30 s" in err) == carry_on, err
