"""A driver started again on the same --state-dir adopts the job its killed predecessor left
running (issue 26, docs/recovery.md "A driver that comes back"): the same worker processes go
on in the same round, with no rollback, and the job ends as a fault-free one. The oracles are
/proc (which processes run, with the test's marker), the workers' ledgers and the model's
hash; the driver's own events are only checked for what it claims to have done."""
import json
import os
import re
import signal
import stat
import time

import pytest

from helpers import (Job, check_event_schema, end_jobs as end, kill_driver, marked_env, run,
                     wait_no_marker, wait_workers, workers)
import ledger

EPOCHS = 12
SAMPLES = 4096


def outage(marker, args, n, slot=None, sig=None):
    """A first driver of n workers, SIGKILLed once epoch 1 is done; then `sig` to the worker
    of `slot`, while no driver runs. Returns (the first Job, the workers' pids then)."""
    first = Job(args, env=marked_env(marker))
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        pids = wait_workers(marker, n)
        kill_driver(first)
        if slot:
            victim = workers(marker, slot)
            assert len(victim) == 1, victim
            os.kill(victim[0], sig)
    except BaseException:
        end(marker, first)
        raise
    return first, pids


def events(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def check_ended(second, book, log, fault_free_hash, max_rollback, lost=()):
    """The job the second driver adopted ended as a fault-free one: its model, every sample
    once (rollbacks up to max_rollback), one driver_resumed that lost `lost`. Returns the
    event log's events and that driver_resumed."""
    assert f"hash {fault_free_hash}" in second.text(), second.text()
    problems = ledger.check(book, SAMPLES, EPOCHS, max_rollback=max_rollback)
    assert not problems, "\n".join(problems)
    evs = events(log)
    resumed = [e for e in evs if e["event"] == "driver_resumed"]
    assert len(resumed) == 1 and resumed[0]["resumed"], resumed
    assert resumed[0]["lost"] == list(lost), resumed
    return evs, resumed[0]


def command(elastic_run, example, state, book, log, np=2, extra=()):
    return [elastic_run, "-np", str(np), "--min-np", "1", "--state-dir", str(state),
            "--driver-timeout", "30", "--event-log", str(log)] + list(extra) + [
            example, "--epochs", str(EPOCHS), "--step-ms", "10", "--ledger", book]


@pytest.mark.parametrize("spares", [0, 1])
def test_a_restarted_driver_adopts_the_running_workers_and_the_round_goes_on(
        elastic_run, example, fault_free_hash, tmp_path, spares):
    """With a warm spare too: it waits for a place, and rides out the outage like a member."""
    marker = f"adopt-{spares}-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log, extra=["--spares", str(spares)])
    first = Job(args, env=marked_env(marker))
    second = None
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        pids = wait_workers(marker, 2 + spares)
        if spares:
            first.wait_for(r"initialised, waiting for a place", timeout=30)
        journal = state / "journal.json"
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(journal).st_mode) == 0o600
        kill_driver(first)
        time.sleep(2.0)  # more than an epoch (about 0.9 s) trained while no driver runs
        second = Job(args, env=marked_env(marker))
        second.wait_for(rf"resuming the job in .*adopted {2 + spares} running worker",
                        timeout=30)
        second.wait_for(rf"{2 + spares} worker\(s\) re-attached", timeout=30)
        # The same processes: nothing was started again.
        assert workers(marker) == pids
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    assert f"hash {fault_free_hash}" in second.text(), second.text()
    # No rollback at all: the round went on (max_rollback 0), every sample once.
    problems = ledger.check(book, SAMPLES, EPOCHS, max_rollback=0)
    assert not problems, "\n".join(problems)
    check_event_schema(log)
    evs = events(log)
    resumed = [e for e in evs if e["event"] == "driver_resumed"]
    assert len(resumed) == 1 and resumed[0]["resumed"], resumed
    assert sorted(resumed[0]["reattached"]) == ["localhost:0", "localhost:1", "localhost:2"][
        :2 + spares], resumed
    assert resumed[0]["lost"] == [] and resumed[0]["restarts"] == 1, resumed
    formed = [e for e in evs if e["event"] == "round_formed"]
    assert len(formed) == 1, formed  # no round after the adoption
    # The output the workers wrote while no driver ran is shown by the second one: between
    # them, the two drivers showed every epoch's line (the second may repeat what the first
    # showed in its last second, see driver/journal.h).
    shown = {int(m.group(1)) for l in first.lines + second.lines
             for m in [re.match(r"\[0\]<stdout>:epoch (\d+) done", l)] if m}
    assert shown == set(range(EPOCHS)), (sorted(shown), first.text(), second.text())
    for line in second.lines:  # whole lines only: none starts in the middle of one
        assert re.match(r"(\[[^\]]+\]<std(out|err)>:|\[\d\d:)", line), line
    assert not journal.exists(), "the journal of an ended job must go"


def programs(marker, name):
    """The test's processes that run the program `name` (argv[0]), from /proc: on the remote
    path, the launch's shells, relays and watchers carry the slot's environment too."""
    out = []
    for pid in workers(marker):
        try:
            argv0 = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0]
        except OSError:
            continue
        if os.path.basename(argv0.decode()) == name:
            out.append(pid)
    return sorted(out)


def test_remote_workers_ride_out_the_outage_and_the_restarted_driver_attaches_to_them(
        elastic_run, example, fault_free_hash, tmp_path):
    """Slots of another host (127.0.0.2 is not this host's name: the remote path, through
    `sh -c` in place of ssh): their launchers die with the driver, the workers train on,
    writing to their folders on the host, and the next driver attaches to them there
    (driver/launch.h), showing what they wrote meanwhile."""
    marker = f"adopt-remote-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log,
                   extra=["-H", "127.0.0.2:2", "--driver-address", "127.0.0.1",
                          # A launcher that writes a line of its own first, as ssh's
                          # warnings do: the worker's header comes after it.
                          "--launcher-template", "echo the launcher speaks >&2; sh -c {command}"])
    first, _ = outage(marker, args, 2)
    second = None
    try:
        pids = programs(marker, "logistic_regression")
        assert len(pids) == 2, pids
        time.sleep(2.0)  # more than an epoch trained while no driver runs
        assert programs(marker, "logistic_regression") == pids, "a worker died with the driver"
        second = Job(args, env=marked_env(marker))
        second.wait_for(r"resuming the job in .*adopted 2 running worker", timeout=30)
        second.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        assert programs(marker, "logistic_regression") == pids
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    evs, resumed = check_ended(second, book, log, fault_free_hash, max_rollback=0)
    assert sorted(resumed["reattached"]) == ["127.0.0.2:0", "127.0.0.2:1"], resumed
    assert len([e for e in evs if e["event"] == "round_formed"]) == 1  # no round after it
    shown = {int(m.group(1)) for l in first.lines + second.lines
             for m in [re.match(r"\[0\]<stdout>:epoch (\d+) done", l)] if m}
    assert shown == set(range(EPOCHS)), (sorted(shown), first.text(), second.text())
    assert "elastic-remote:" not in first.text() + second.text()  # the header is not output
    assert "<stderr>:the launcher speaks" in first.text()
    exits = [e for e in evs if e["event"] == "worker_exited"]
    assert sorted(e["slot"] for e in exits) == ["127.0.0.2:0", "127.0.0.2:1"], exits
    assert all(e["code"] == 0 for e in exits), exits


def test_a_worker_that_died_during_the_outage_is_lost_and_the_job_goes_on(
        elastic_run, example, fault_free_hash, tmp_path):
    marker = f"adopt-lost-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log, np=3)
    first, _ = outage(marker, args, 3, "localhost:2", signal.SIGKILL)
    second = None
    try:
        time.sleep(0.5)
        second = Job(args, env=marked_env(marker))
        second.wait_for(r"adopted 2 running worker.*1 ended while no driver ran \[localhost:2\]",
                        timeout=30)
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    assert f"hash {fault_free_hash}" in second.text(), second.text()
    problems = ledger.check(book, SAMPLES, EPOCHS, max_rollback=5)
    assert not problems, "\n".join(problems)
    evs = events(log)
    resumed = [e for e in evs if e["event"] == "driver_resumed"]
    assert len(resumed) == 1 and resumed[0]["lost"] == ["localhost:2"], resumed
    # How it ended is known, though no driver was its parent: its status keeper recorded it.
    exits = [e for e in evs if e["event"] == "worker_exited" and e["slot"] == "localhost:2"]
    assert [(e["code"], e["status"]) for e in exits] == [
        (137, "ended while no driver ran: signal 9 (Killed) (recorded by its status keeper)")], exits


def proc_state(pid):
    """The one-letter state in /proc/PID/stat ("T": stopped), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def all_threads_stopped(pid):
    """Every thread of PID is stopped ("T" in /proc/PID/task/TID/stat). The kernel counts a
    process as stopped (for the orphaned-group SIGHUP among others) only once its whole group
    stop is complete: its main thread shows "T" as soon as it stopped itself, and a busy
    machine can take a while to stop the others."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "T":
                    return False
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended
    return True


@pytest.mark.parametrize("under", [[], ["nohup"]])
def test_a_worker_stopped_when_the_driver_dies_is_ended_with_it_and_the_job_goes_on(
        elastic_run, example, fault_free_hash, tmp_path, under):
    """A member stopped (SIGSTOP) while the driver runs, the driver SIGKILLed before it noticed:
    the member's process group is orphaned by the driver's death, so the kernel sends the
    stopped member SIGHUP (and SIGCONT) at once, as it did before workers had status keepers
    (the keeper is a member of the group, so the group still has a parent outside it only
    while the driver lives). The adopting driver learns that end from the keeper and re-forms
    at once: it does not wait --rendezvous-timeout for a member that would never re-attach.
    The oracle for the end is /proc: the stopped worker is gone before a second driver
    starts. Also under nohup: a driver whose SIGHUP is ignored does not pass that on to its
    workers (a fresh-clone CI run started under nohup failed here without that)."""
    marker = f"adopt-stopped-first-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log, np=3,
                   extra=["--rendezvous-timeout", "120"])
    first = Job(under + args, env=marked_env(marker))
    second = None
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        wait_workers(marker, 3)
        victim = workers(marker, "localhost:2")
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not all_threads_stopped(victim[0]):
            assert time.monotonic() < deadline, "the worker did not stop"
            time.sleep(0.01)
        kill_driver(first)
        deadline = time.monotonic() + 15
        while proc_state(victim[0]) not in (None, "Z"):
            assert time.monotonic() < deadline, (
                f"the stopped worker is still there ({proc_state(victim[0])}) after its "
                "driver died: its group was not orphaned")
            time.sleep(0.05)
        second = Job(args, env=marked_env(marker))
        second.wait_for(r"adopted 2 running worker.*1 ended while no driver ran \[localhost:2\]",
                        timeout=30)
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    evs, _ = check_ended(second, book, log, fault_free_hash, max_rollback=5, lost=["localhost:2"])
    exits = [e for e in evs if e["event"] == "worker_exited" and e["slot"] == "localhost:2"]
    assert [(e["code"], e["status"]) for e in exits] == [
        (129, "ended while no driver ran: signal 1 (Hangup) (recorded by its status keeper)")], exits


def adopted_run(marker, args):
    """The job of `args` with its driver SIGKILLed once epoch 1 is done, and a second driver
    that adopts its 2 workers and ends it. Returns (its exit code, the second Job)."""
    first = Job(args, env=marked_env(marker))
    second = None
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        kill_driver(first)
        second = Job(args, env=marked_env(marker))
        second.wait_for(r"resuming the job in .*adopted 2 running worker", timeout=30)
        rc = second.wait(timeout=120)
    finally:
        end(marker, first, second)
    return rc, second


# After training, the worker of slot localhost:1 ends badly: a shell wrapper around it exits
# 3, or kills itself with SIGSEGV, once the program has reported FINISHED and exited 0.
FAIL_AFTER = ('"$@"; c=$?; [ "$ELASTIC_SLOT" = localhost:1 ] && [ $c -eq 0 ] && '
              '{ sleep 0.3; %s; }; exit $c')


@pytest.mark.parametrize("ending,code,status", [
    ("exit 3", 3, "exit status 3"),
    ("kill -SEGV $$", 139, "signal 11 (Segmentation fault)"),
    (None, None, "signal 11 (Segmentation fault)")])
def test_an_adopted_worker_that_fails_at_its_end_fails_the_job(
        elastic_run, example, tmp_path, ending, code, status):
    """A driver that adopted the job is not the workers' parent, yet it learns how each ended
    (its status keeper recorded it, common/process.h): a worker that reported FINISHED and
    then exits 3, or crashes, is a failed worker and the job fails with its code, as under
    the driver that started it; never a silent success. The wrapper's shell is adopted too:
    the keeper, not the driver, is its parent, so it does not die with the driver (the
    PR_SET_PDEATHSIG a local worker is started with). Last, every worker crashing as its
    training ends (the example's --final-exit -11, before FINISHED is out): they failed,
    there is no one left, and the job fails."""
    marker = f"adopt-fail-{code}-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log)
    if ending:
        at = args.index(example)
        args[at:at] = ["sh", "-c", FAIL_AFTER % ending, "sh"]
    else:
        args += ["--final-exit", "-11"]
    rc, second = adopted_run(marker, args)
    assert rc != 0 and rc == (code or rc), second.text()
    assert f"failed: {status} (recorded by its status keeper)" in second.text(), second.text()
    exits = {e["slot"]: e for e in events(log) if e["event"] == "worker_exited"}
    assert exits["localhost:1"]["code"] == (code or 139), exits
    assert exits["localhost:0"]["code"] == (0 if ending else 139), exits
    ended = [e for e in events(log) if e["event"] == "job_ended"]
    assert [e["code"] for e in ended] == [rc], ended


@pytest.mark.parametrize("ending,code,status", [
    ("exit 3", 3, "exit status 3"),
    ("kill -SEGV $$", 139, "signal 11 (Segmentation fault)")])
def test_an_adopted_remote_worker_that_fails_at_its_end_fails_the_job(
        elastic_run, example, tmp_path, ending, code, status):
    """The same on another host (127.0.0.2, through `sh -c` in place of ssh): the launch
    script dies with the driver, the worker's keeper there does not (a session of its own,
    driver/launch.h), and the attach script of the driver that adopted the job exits with
    the status the keeper recorded."""
    marker = f"adopt-remote-fail-{code}-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log,
                   extra=["-H", "127.0.0.2:2", "--driver-address", "127.0.0.1",
                          "--launcher-template", "sh -c {command}"])
    at = args.index(example)
    args[at:at] = ["sh", "-c", FAIL_AFTER.replace("localhost:1", "127.0.0.2:1") % ending, "sh"]
    rc, second = adopted_run(marker, args)
    assert rc == code, second.text()
    assert (f"failed: {status} (recorded by its status keeper on 127.0.0.2)"
            in second.text()), second.text()
    exits = {e["slot"]: e for e in events(log) if e["event"] == "worker_exited"}
    assert exits["127.0.0.2:1"]["code"] == code, exits
    assert exits["127.0.0.2:0"]["code"] == 0, exits


def test_a_journal_whose_workers_are_all_gone_starts_the_job_afresh(
        elastic_run, example, fault_free_hash, tmp_path):
    marker = f"adopt-stale-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log)
    args[args.index("--driver-timeout") + 1] = "1"
    first, _ = outage(marker, args, 2)
    second = None
    try:
        assert not wait_no_marker(marker, timeout=15)  # they gave up on the driver
        second = Job(args, env=marked_env(marker))
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    assert "whose workers are all gone" in second.text() and "afresh" in second.text()
    assert f"hash {fault_free_hash}" in second.text(), second.text()
    resumed = [e for e in events(log) if e["event"] == "driver_resumed"]
    assert len(resumed) == 1 and resumed[0]["resumed"] is False, resumed


def test_fresh_kills_the_journals_workers_and_starts_over(elastic_run, example,
                                                          fault_free_hash, tmp_path):
    marker = f"adopt-fresh-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log)
    first, old = outage(marker, args, 2)
    second = None
    try:
        second = Job(args[:1] + ["--fresh"] + args[1:], env=marked_env(marker))
        second.wait_for(r"--fresh: not resuming the job", timeout=30)
        assert second.wait(timeout=120) == 0, second.text()
        assert not set(old) & set(workers(marker))
    finally:
        end(marker, first, second)
    assert "still running were killed" in second.text(), second.text()
    assert f"hash {fault_free_hash}" in second.text(), second.text()


def test_the_folder_of_a_live_driver_or_of_another_command_is_refused(elastic_run, example,
                                                                      tmp_path):
    marker = f"adopt-refused-{os.getpid()}"
    state = tmp_path / "state"
    args = command(elastic_run, example, state, str(tmp_path / "ledger"),
                   tmp_path / "events.jsonl")
    first = Job(args, env=marked_env(marker))
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 0 done", timeout=60)
        rc, out = run(args, timeout=30)
        assert rc == 1 and "is held by a running driver" in out, out
        kill_driver(first)
        other = args[:-1] + [str(tmp_path / "other-ledger")]
        rc, out = run(other, timeout=30)
        assert rc == 2 and "journal of another command line" in out and "--fresh" in out, out
    finally:
        end(marker, first)
    rc, out = run([elastic_run, "--fresh", "-np", "1", "true"], timeout=30)
    assert rc == 2 and "--fresh" in out and "--state-dir" in out, out


def test_a_worker_that_does_not_reattach_is_lost_at_the_rendezvous_timeout(
        elastic_run, example, fault_free_hash, tmp_path):
    """A member stopped (SIGSTOP) while no driver ran never re-opens its stream: the driver
    that adopts the job loses it after --rendezvous-timeout, its peers re-form without it."""
    marker = f"adopt-stopped-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log, np=3,
                   extra=["--rendezvous-timeout", "3"])
    first, _ = outage(marker, args, 3, "localhost:1", signal.SIGSTOP)
    victim = workers(marker, "localhost:1")
    second = None
    try:
        second = Job(args, env=marked_env(marker))
        second.wait_for(r"adopted 3 running worker", timeout=30)
        second.wait_for(r"2 worker\(s\) re-attached in .*; lost: \[localhost:1\]", timeout=30)
        assert second.wait(timeout=120) == 0, second.text()
        assert victim[0] not in workers(marker)  # killed by the driver, not left stopped
    finally:
        end(marker, first, second)
    assert f"hash {fault_free_hash}" in second.text(), second.text()
    problems = ledger.check(book, SAMPLES, EPOCHS, max_rollback=5)
    assert not problems, "\n".join(problems)
    resumed = [e for e in events(log) if e["event"] == "driver_resumed"]
    assert len(resumed) == 1 and resumed[0]["lost"] == ["localhost:1"], resumed


def test_workers_that_finished_while_no_driver_ran_wait_for_it_and_end_the_job(
        elastic_run, example, fault_free_hash, tmp_path):
    """The driver killed three epochs before the end: the workers finish training without it
    and wait (up to --driver-timeout) to tell it. A driver started again after more than a
    report's own 30 s timeout finds the same processes, hears that they finished, and ends the
    job as a success, without training anything again."""
    marker = f"adopt-finished-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log)
    args[args.index("--driver-timeout") + 1] = "90"
    first = Job(args, env=marked_env(marker))
    second = None
    try:
        first.wait_for(rf"\[0\]<stdout>:epoch {EPOCHS - 3} done", timeout=60)
        pids = wait_workers(marker, 2)
        killed_at = kill_driver(first)
        # Training ends without the driver: every epoch's steps are in the ledger.
        deadline = time.monotonic() + 60
        while max((l.epoch for l in ledger.read(book)), default=-1) < EPOCHS - 1:
            assert time.monotonic() < deadline, "training did not end without the driver"
            time.sleep(0.2)
        time.sleep(max(0.0, killed_at + 34 - time.time()))
        assert workers(marker) == pids, "a finished worker gave up on the driver too soon"
        second = Job(args, env=marked_env(marker))
        assert second.wait(timeout=60) == 0, second.text()
        assert "success" in second.text(), second.text()
    finally:
        end(marker, first, second)
    # The fault-free model, printed by rank 0 while no driver ran, is shown by the second.
    evs, _ = check_ended(second, book, log, fault_free_hash, max_rollback=0)
    assert len([e for e in evs if e["event"] == "round_formed"]) == 1, "trained again"


def test_a_driver_killed_during_a_sync_is_adopted_and_the_sync_goes_on(
        elastic_run, example, fault_free_hash, tmp_path):
    """A member killed, its relaunched process taking the state from rank 0 (a test hook
    holds rank 0 in the sync for 4 s), and the driver SIGKILLed in that window: the sync needs
    no driver, and the driver started again adopts the round being synced."""
    marker = f"adopt-sync-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log, np=3,
                   extra=["--host-failure-limit", "0"])  # the slot is started again
    env = marked_env(marker, ELASTIC_TEST_HOOKS="sync_root@*@1+@1+=sleep4000")
    first = Job(args, env=env)
    second = None
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        wait_workers(marker, 3)
        victim = workers(marker, "localhost:2")
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        first.wait_for(r"test hook sync_root fired: sleep4000", timeout=60)
        kill_driver(first)
        pids = workers(marker)
        assert len(pids) == 3 and victim[0] not in pids, pids
        time.sleep(1)
        second = Job(args, env=env)
        second.wait_for(r"3 worker\(s\) re-attached", timeout=30)
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    evs, resumed = check_ended(second, book, log, fault_free_hash, max_rollback=5)
    # The synced round went on: no round formed after the adoption.
    formed = [e for e in evs if e["event"] == "round_formed"]
    assert formed[-1]["ts"] < resumed["ts"], (formed, resumed)


def test_a_member_sent_away_before_it_reattached_is_not_counted_lost(
        elastic_run, example, fault_free_hash, tmp_path):
    """Chaos soak (seed 317254297, job 3): the driver that adopted the job scaled a member
    away, the member heard of it in its Join and ended before its own stream to the new driver
    was open again; `driver_resumed` counted it lost. A test hook holds that member's re-open
    for 4 s while its host is scaled down."""
    from helpers import Discovery
    marker = f"adopt-away-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    disc = Discovery(tmp_path, "localhost:3")
    args = [elastic_run, "--min-np", "1", "--max-np", "3", "--host-discovery-script",
            str(disc.script), "--state-dir", str(state), "--driver-timeout", "30",
            "--event-log", str(log), example, "--epochs", str(EPOCHS), "--step-ms", "10",
            "--ledger", book]
    env = marked_env(marker, ELASTIC_TEST_HOOKS="watch_lost@localhost:2@*@*=sleep4000")
    first = Job(args, env=env)
    second = None
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        wait_workers(marker, 3)
        away = workers(marker, "localhost:2")
        kill_driver(first)
        disc.set("localhost:2")
        second = Job(args, env=env)
        second.wait_for(r"2 worker\(s\) re-attached in .*; sent away before they re-attached: "
                        r"\[localhost:2\]", timeout=30)
        assert away[0] not in workers(marker)
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    check_event_schema(log)
    _, resumed = check_ended(second, book, log, fault_free_hash, max_rollback=0)
    assert resumed["left"] == ["localhost:2"], resumed


def test_a_driver_killed_twice_is_adopted_twice_and_the_round_goes_on(
        elastic_run, example, fault_free_hash, tmp_path):
    """The driver that adopted the job is SIGKILLed too: the third one adopts it from the
    journal the second wrote (the same processes, restarts 2), and the job ends as a fault-free
    one with no rollback."""
    marker = f"adopt-twice-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log)
    first, pids = outage(marker, args, 2)
    second = third = None
    try:
        time.sleep(1.0)
        second = Job(args, env=marked_env(marker))
        second.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        # Once the second driver has shown a line of its own workers' output, the journal it
        # wrote is the one the third must adopt from.
        second.wait_for(r"\[0\]<stdout>:epoch [3-9] done", timeout=60)
        kill_driver(second)
        time.sleep(1.0)
        third = Job(args, env=marked_env(marker))
        third.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        assert workers(marker) == pids, "a worker was started again"
        assert third.wait(timeout=120) == 0, third.text()
    finally:
        end(marker, first, second, third)
    assert f"hash {fault_free_hash}" in third.text(), third.text()
    problems = ledger.check(book, SAMPLES, EPOCHS, max_rollback=0)
    assert not problems, "\n".join(problems)
    evs = events(log)
    resumed = [e for e in evs if e["event"] == "driver_resumed"]
    assert [e["restarts"] for e in resumed] == [1, 2], resumed
    assert all(e["resumed"] and e["lost"] == [] for e in resumed), resumed
    assert len([e for e in evs if e["event"] == "round_formed"]) == 1  # no round after either
    assert not (state / "journal.json").exists()


def test_a_driver_killed_during_a_rendezvous_is_adopted_and_the_round_forms(
        elastic_run, example, fault_free_hash, tmp_path):
    """A slot added by discovery gets a newcomer and the driver proposes a round with it; a
    test hook holds rank 0 in a commit for 5 s, so the round is proposed but not formed when
    the driver is SIGKILLed. The next driver proposes it again, the members and the newcomer
    (which waited in its Join for a driver) form it, and the job ends as a fault-free one."""
    from helpers import Discovery
    marker = f"adopt-rdzv-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    disc = Discovery(tmp_path, "localhost:2")
    args = [elastic_run, "--min-np", "1", "--max-np", "3", "--host-discovery-script",
            str(disc.script), "--discovery-interval", "0.2", "--state-dir", str(state),
            "--driver-timeout", "30", "--event-log", str(log), example, "--epochs",
            str(EPOCHS), "--step-ms", "10", "--ledger", book]
    env = marked_env(marker, ELASTIC_TEST_HOOKS="before_save@localhost:0@0@200+=sleep5000")
    first = Job(args, env=env)
    second = None
    try:
        first.wait_for(r"test hook before_save fired: sleep5000", timeout=90)
        disc.set("localhost:3")
        first.wait_for(r"round 1: the new worker in slot localhost:2 takes its place", timeout=30)
        kill_driver(first)
        pids = workers(marker)
        assert len(pids) == 3, pids
        time.sleep(1.0)
        second = Job(args, env=env)
        second.wait_for(r"round 1 was proposed but not formed when the driver before this one "
                        r"died: proposing it again", timeout=30)
        assert second.wait(timeout=120) == 0, second.text()
        assert not set(pids) - set(workers(marker)) - set(pids), pids
    finally:
        end(marker, first, second)
    check_event_schema(log)
    evs, _ = check_ended(second, book, log, fault_free_hash, max_rollback=0)
    formed = [e for e in evs if e["event"] == "round_formed"]
    assert [e["round"] for e in formed] == [0, 1], formed
    assert len(formed[-1]["members"]) == 3, formed
    # Every step of the job after the rendezvous was taken by three ranks: the newcomer trained.
    assert any(l.rank == 2 and l.size == 3 for l in ledger.read(book))


def test_a_damaged_journal_is_refused_and_the_job_it_names_is_not_harmed(
        elastic_run, example, fault_free_hash, tmp_path):
    """A journal cut short (a full disk, a copy gone wrong) is refused with exit 2, naming it;
    the workers it names go on training untouched, and once the journal is whole again the
    same command adopts them."""
    marker = f"adopt-damaged-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log)
    first, pids = outage(marker, args, 2)
    second = None
    journal = state / "journal.json"
    try:
        whole = journal.read_bytes()
        bad_policy = json.loads(whole)
        bad_policy["policy"]["resets"] = "zero"  # whole JSON, but not a policy state
        for damaged in (whole[:len(whole) // 2], b"", b"{\"version\": \"x\"}",
                        json.dumps(bad_policy).encode()):
            journal.write_bytes(damaged)
            os.chmod(journal, 0o600)
            rc, out = run(args, timeout=30, env=marked_env(marker))
            assert rc == 2, out
            assert str(journal) in out, out
            assert journal.read_bytes() == damaged, "the refused journal was changed"
            assert workers(marker) == pids, "a worker of the refused journal was harmed"
        journal.write_bytes(whole)
        second = Job(args, env=marked_env(marker))
        second.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    check_ended(second, book, log, fault_free_hash, max_rollback=0)


def test_a_process_with_a_wrong_token_or_an_unknown_slot_is_refused_by_the_adopting_driver(
        elastic_run, example, fault_free_hash, tmp_path):
    """While the adopting driver waits for the members to re-attach, a process that presents
    itself as a member with a wrong job token, and one with a slot the journal does not know,
    are refused; the real members re-attach and the job is untouched."""
    marker = f"adopt-refuse-{os.getpid()}"
    state, book, log = tmp_path / "state", str(tmp_path / "ledger"), tmp_path / "events.jsonl"
    args = command(elastic_run, example, state, book, log)
    # The members' re-open waits 3 s after the driver is back, so the impostors come first.
    env = marked_env(marker, ELASTIC_TEST_HOOKS="watch_lost@*@*@*=sleep3000")
    first = Job(args, env=env)
    second = None
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        pids = wait_workers(marker, 2)
        kill_driver(first)
        member = workers(marker, "localhost:1")[0]
        with open(f"/proc/{member}/environ", "rb") as f:
            member_env = dict(kv.decode().split("=", 1)
                              for kv in f.read().split(b"\0") if b"=" in kv)
        member_env.pop("ELASTIC_TEST_HOOKS", None)
        second = Job(args, env=env)
        second.wait_for(r"resuming the job in .*adopted 2 running worker", timeout=30)
        # The same slot and worker id with a wrong token: its agent's Watch is refused and
        # it exits 3. A slot of no round: its Join is refused, and the program gets the error.
        impostors = [
            (dict(member_env, ELASTIC_JOB_TOKEN="x" * 64), 3, "refused this worker's Watch"),
            (dict(member_env, ELASTIC_SLOT="localhost:7", ELASTIC_WORKER_ID="impostor"), 1,
             "slot localhost:7 is not a slot of this job"),
        ]
        for impostor_env, code, says in impostors:
            rc, out = run([example, "--epochs", "1"], timeout=30, env=impostor_env)
            assert rc == code and says in out, out
        second.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        assert workers(marker) == pids
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        end(marker, first, second)
    check_ended(second, book, log, fault_free_hash, max_rollback=0)
