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

from helpers import Job, procs_with_marker, run, wait_no_marker
import ledger
from test_driver_outage import kill_driver, marked_env, wait_workers, workers
from test_elastic import check_event_schema

EPOCHS = 12
SAMPLES = 4096


@pytest.fixture(scope="module")
def example(build_dir):
    return str(build_dir / "examples" / "logistic_regression")


@pytest.fixture(scope="module")
def fault_free_hash(elastic_run, example):
    rc, out = run([elastic_run, "-np", "2", example, "--epochs", str(EPOCHS)])
    assert rc == 0, out
    return ledger.final_hash(out)


def end(marker, *jobs):
    """Every process of the test gone: its drivers, and the workers of a killed one (which
    would otherwise wait --driver-timeout for a driver)."""
    for job in jobs:
        if job:
            job.kill()
    for pid in procs_with_marker(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not wait_no_marker(marker, timeout=15)


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
    resumed = [e for e in events(log) if e["event"] == "driver_resumed"]
    assert len(resumed) == 1 and resumed[0]["lost"] == ["localhost:2"], resumed


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
