"""Elasticity end to end: real processes under elastic-run, discovery through a file the test
rewrites, the C++ logistic-regression example as the training program."""
import os
import signal

import pytest

import ledger
from helpers import (Discovery, Job, check_event_schema, cpp_fault_free, events, run, wait_event,
                     worker_pid)


@pytest.fixture(scope="module")
def baseline(elastic_run, example):
    return cpp_fault_free(elastic_run, example, "--epochs", "6")


def check_exactly_once(prefix, samples, epochs, commit_every=4):
    problems = ledger.check(prefix, samples, epochs, max_rollback=commit_every + 1)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("victim", ["localhost:2", "localhost:0"])
def test_kill_a_worker_survivors_recover_with_the_fault_free_result(
        elastic_run, example, baseline, tmp_path, victim):
    log = str(tmp_path / "events.jsonl")
    book = str(tmp_path / "ledger")
    job = Job([elastic_run, "-np", "4", "--min-np", "2", "--event-log", log, example,
               "--epochs", "6", "--step-ms", "10", "--ledger", book])
    try:
        job.wait_for(r"epoch 0 done")
        os.kill(worker_pid(log, victim), signal.SIGKILL)  # rank 0 too: it syncs newcomers
        assert job.wait() == 0, job.text()
        assert baseline in job.text()
        check_exactly_once(book, samples=4096, epochs=6)
        formed = [e for e in events(log) if e["event"] == "round_formed"]
        survivors = [s for s in ["localhost:0", "localhost:1", "localhost:2", "localhost:3"]
                     if s != victim]
        assert sorted(formed[-1]["members"]) == survivors
        phases = {e["phase"] for e in events(log) if e["event"] == "recovery_phase"}
        assert {"fence", "rendezvous", "first_step"} <= phases
        check_event_schema(log)
        committed = [e for e in events(log) if e["event"] == "committed"]
        # The example's state has a sampler: real epochs and cursors, and samples add up.
        assert committed and all(e["epoch"] is not None for e in committed)
        assert any(e["epoch"] > 0 or e["cursor"] > 0 for e in committed), committed
        assert all(e["samples"] == e["epoch"] * 4096 + e["cursor"] for e in committed)
        exited = [e for e in events(log) if e["event"] == "worker_exited"]
        assert any(e["slot"] == victim and e["code"] == 128 + 9 for e in exited), exited
    finally:
        job.kill()


def test_hosts_added_and_removed_through_discovery(elastic_run, example, baseline, tmp_path):
    log = str(tmp_path / "events.jsonl")
    disc = Discovery(tmp_path, "localhost:2")
    job = Job([elastic_run, "--min-np", "2", "--max-np", "4", "--host-discovery-script",
               str(disc.script), "--event-log", log, example, "--epochs", "6", "--step-ms", "10"])
    try:
        job.wait_for(r"epoch 0 done")
        disc.set("localhost:4")
        wait_event(log, lambda e: e["event"] == "round_formed" and len(e["members"]) == 4)
        disc.set("localhost:3")
        removed = wait_event(log, lambda e: e["event"] == "worker_exited"
                             and e["slot"] == "localhost:3")
        assert removed["code"] == 0
        assert job.wait() == 0, job.text()
        assert baseline in job.text()
        formed = [e for e in events(log) if e["event"] == "round_formed"]
        # 2, then 4 (the newcomers of the two new slots join as each gets ready: one round
        # change, or two when the first re-formed before the second was ready), then 3.
        sizes = [len(e["members"]) for e in formed]
        assert sizes in ([2, 4, 3], [2, 3, 4, 3]), sizes
    finally:
        job.kill()


def committed_in(log, rnd):
    return lambda e: e["event"] == "committed" and e["round"] == rnd


def test_exactly_once_under_kills_additions_and_removals(elastic_run, example, tmp_path):
    """Each fault waits for the previous one's recovery (a commit in the new round), from the
    event log; the job has epochs enough for the whole schedule, and the test checks that the
    schedule ran before training ended."""
    log = str(tmp_path / "events.jsonl")
    book = str(tmp_path / "ledger")
    disc = Discovery(tmp_path, "localhost:3")
    args = ["--epochs", "30", "--step-ms", "10", "--commit-every", "3"]
    want = cpp_fault_free(elastic_run, example, *args)
    job = Job([elastic_run, "--min-np", "2", "--max-np", "4", "--host-discovery-script",
               str(disc.script), "--host-failure-limit", "0", "--event-log", log, example]
              + args + ["--ledger", book])
    try:
        job.wait_for(r"epoch 0 done")
        os.kill(worker_pid(log, "localhost:1"), signal.SIGKILL)     # kill
        r = wait_event(log, lambda e: e["event"] == "round_formed" and e["round"] >= 1)
        wait_event(log, committed_in(log, r["round"]))
        disc.set("localhost:4")                                        # add
        r = wait_event(log, lambda e: e["event"] == "round_formed" and len(e["members"]) == 4)
        wait_event(log, committed_in(log, r["round"]))
        disc.set("localhost:2")                                        # remove
        r = wait_event(log, lambda e: e["event"] == "round_formed" and len(e["members"]) == 2)
        wait_event(log, committed_in(log, r["round"]))
        assert job.wait() == 0, job.text()
        assert want in job.text()
    finally:
        job.kill()
    check_exactly_once(book, samples=4096, epochs=30, commit_every=3)


def test_below_min_np_waits_then_goes_on(elastic_run, example, baseline, tmp_path):
    log = str(tmp_path / "events.jsonl")
    disc = Discovery(tmp_path, "localhost:1")
    job = Job([elastic_run, "--min-np", "2", "--host-discovery-script", str(disc.script),
               "--event-log", log, example, "--epochs", "6"])
    try:
        wait_event(log, lambda e: e["event"] == "waiting_for_hosts")
        disc.set("localhost:2")
        assert job.wait() == 0, job.text()
        assert baseline in job.text()
    finally:
        job.kill()


def test_below_min_np_times_out_with_a_message(elastic_run, example, tmp_path):
    # The host could come back after its cooldown (100 s), so the job waits, up to 1 s.
    log = str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "-np", "2", "--min-np", "2", "--elastic-timeout", "1",
               "--blacklist-cooldown-range", "100", "200",
               "--event-log", log, example, "--epochs", "100", "--step-ms", "10"])
    try:
        job.wait_for(r"epoch 0 done")
        os.kill(worker_pid(log, "localhost:1"), signal.SIGKILL)
        assert job.wait() == 1, job.text()
        assert "timed out waiting for --min-np 2 workers" in job.text()
    finally:
        job.kill()


def test_start_timeout_when_hosts_never_come(elastic_run, example, tmp_path):
    disc = Discovery(tmp_path, "localhost:1")
    rc, out = run([elastic_run, "--min-np", "2", "--start-timeout", "1",
                   "--host-discovery-script", str(disc.script), example])
    assert rc == 1, out
    assert "timed out waiting for -np 2 workers" in out


def test_reset_limit_fails_the_job(elastic_run, example, tmp_path):
    log = str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--reset-limit", "0",
               "--event-log", log, example, "--epochs", "100", "--step-ms", "10"])
    try:
        job.wait_for(r"epoch 0 done")
        os.kill(worker_pid(log, "localhost:2"), signal.SIGKILL)
        assert job.wait() == 1, job.text()
        assert "reset limit reached" in job.text()
    finally:
        job.kill()


def test_blacklisted_host_comes_back_after_its_cooldown(elastic_run, example, baseline, tmp_path):
    log = str(tmp_path / "events.jsonl")
    disc = Discovery(tmp_path, "localhost:3")
    job = Job([elastic_run, "--min-np", "2", "--host-discovery-script", str(disc.script),
               "--blacklist-cooldown-range", "0.5", "1", "--event-log", log, example,
               "--epochs", "6", "--step-ms", "10"])
    try:
        job.wait_for(r"epoch 0 done")
        os.kill(worker_pid(log, "localhost:2"), signal.SIGKILL)
        wait_event(log, lambda e: e["event"] == "host_blacklisted")
        # The cooldown's end starts a newcomer in the slot (the others train on without it);
        # the job is back at 3 once it is ready.
        back = wait_event(log, lambda e: e["event"] == "newcomer_started"
                          and e["reason"] == "a blacklist cooldown ended")
        assert back["slot"] == "localhost:2"
        wait_event(log, lambda e: e["event"] == "round_formed" and e["ts"] > back["ts"]
                   and len(e["members"]) == 3)
        assert job.wait() == 0, job.text()
        assert baseline in job.text()
    finally:
        job.kill()


BAD_SCRIPTS = {
    "fail": "echo 'cloud API down' >&2; exit 3",
    "hang": "sleep 1000",
    "garbage": "echo 'this is not a host list!'",
    "huge": "head -c 10000000 /dev/zero | tr '\\0' 'a'",
}


@pytest.mark.parametrize("mode", list(BAD_SCRIPTS) + ["deleted"])
def test_bad_discovery_script_keeps_the_last_good_hosts(elastic_run, example, baseline,
                                                        tmp_path, mode):
    log = str(tmp_path / "events.jsonl")
    mode_file = tmp_path / "mode"
    mode_file.write_text("good")
    script = tmp_path / "discover.sh"
    cases = "".join(f"  {m}) {body} ;;\n" for m, body in BAD_SCRIPTS.items())
    script.write_text(f"#!/bin/sh\ncase $(cat {mode_file}) in\n{cases}"
                      f"  *) echo localhost:2 ;;\nesac\n")
    script.chmod(0o755)
    job = Job([elastic_run, "--min-np", "2", "--host-discovery-script", str(script),
               "--discovery-timeout", "1", "--event-log", log, example, "--epochs", "6",
               "--step-ms", "10"])
    try:
        job.wait_for(r"epoch 0 done")
        if mode == "deleted":
            script.unlink()
        else:
            mode_file.write_text(mode)
        wait_event(log, lambda e: e["event"] == "discovery" and not e["ok"])
        assert job.wait() == 0, job.text()
        assert baseline in job.text()
        assert "keeping the last good host set" in job.text()
    finally:
        job.kill()


def test_first_discovery_failure_is_fatal_and_shows_stderr(elastic_run, example, tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 'no credentials for the cloud API' >&2\nexit 4\n")
    script.chmod(0o755)
    rc, out = run([elastic_run, "--min-np", "1", "--host-discovery-script", str(script), example])
    assert rc == 1, out
    assert "no credentials for the cloud API" in out and "exited with status 4" in out


def test_the_example_gives_the_same_model_at_1_2_and_4_workers(elastic_run, example, baseline):
    for np in (1, 4):
        rc, out = run([elastic_run, "-np", str(np), example, "--epochs", "6"])
        assert rc == 0, out
        assert baseline in out
