"""Elasticity end to end: real processes under elastic-run, discovery through a file the test
rewrites, the C++ logistic-regression example as the training program."""
import json
import os
import re
import signal
import time

import pytest

import ledger
from helpers import Job, run


@pytest.fixture(scope="module")
def example(build_dir):
    return str(build_dir / "examples" / "logistic_regression")


def fault_free(elastic_run, example, *args):
    """The hash of the fault-free model (bit for bit the same at any number of workers)."""
    rc, out = run([elastic_run, "-np", "2", example] + list(args))
    assert rc == 0, out
    return "hash " + ledger.final_hash(out)


@pytest.fixture(scope="module")
def baseline(elastic_run, example):
    return fault_free(elastic_run, example, "--epochs", "6")


class Discovery:
    """A discovery script that prints a file; the test rewrites the file."""

    def __init__(self, tmp_path, hosts):
        self.file = tmp_path / "hosts.txt"
        self.script = tmp_path / "discover.sh"
        self.script.write_text(f"#!/bin/sh\ncat {self.file}\n")
        self.script.chmod(0o755)
        self.set(hosts)

    def set(self, hosts):
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(hosts + "\n")
        os.replace(tmp, self.file)


def events(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def wait_event(path, pred, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(path):
            if pred(e):
                return e
        time.sleep(0.05)
    raise AssertionError(f"no matching event in {path}: {events(path)[-10:]}")


def worker_pid(log, slot):
    starts = [e for e in events(log) if e["event"] == "worker_started" and e["slot"] == slot]
    return starts[-1]["pid"]


# The event log's schema as the README documents it: event -> {field: type or tuple of types}.
INT, NUM, STR, BOOL, NULL, LIST = int, (int, float), str, bool, type(None), list
EVENT_SCHEMA = {
    "discovery": {"ok": BOOL},
    "host_added": {"host": STR}, "host_removed": {"host": STR},
    "host_changed": {"host": STR, "slots": INT},
    "host_blacklisted": {"host": STR, "cooldown": (int, float, NULL)},
    "waiting_for_hosts": {"available": INT, "needed": INT},
    "round_proposed": {"round": INT, "members": LIST, "removed": LIST, "reason": STR},
    "round_withdrawn": {"round": INT, "reason": STR},
    "fence": {"round": INT, "reason": STR},
    "round_formed": {"round": INT, "members": LIST, "versions": LIST, "version": INT,
                     "sync_required": BOOL},
    "worker_started": {"slot": STR, "pid": INT, "spare": BOOL},
    "spare_promoted": {"slot": STR, "round": INT},
    "worker_start_failed": {"slot": STR, "error": STR},
    "committed": {"slot": STR, "round": INT, "version": INT, "step": INT,
                  "epoch": (int, NULL), "cursor": (int, NULL), "samples": (int, NULL)},
    "worker_lost": {"slot": STR, "rank": (int, NULL)},
    "worker_leaving": {"slot": STR, "rank": (int, NULL), "reason": STR},
    "member_left": {"slot": STR, "round": INT},
    "worker_exited": {"slot": STR, "rank": (int, NULL), "round": INT, "code": INT,
                      "status": STR},
    "recovery_phase": {"phase": STR, "seconds": NUM},
    "holder_kept": {"slot": STR, "version": INT},
    "state_lost": {"round": INT, "newest_committed": INT, "members": LIST, "start_over": BOOL},
    "job_ending": {"code": INT, "message": STR}, "job_ended": {"code": INT, "message": STR},
    "worker_hung": {"slot": STR, "rank": (int, NULL), "host": STR, "pid": INT, "step": INT,
                    "reason": STR},
    "round_hung": {"round": INT, "seconds": NUM},
    "checkpoint_written": {"slot": STR, "version": INT, "step": INT, "epoch": (int, NULL),
                           "path": STR, "seconds": NUM},
    "checkpoint_failed": {"slot": STR, "version": INT, "message": STR},
    "state_restored": {"round": INT, "slot": STR, "version": INT, "step": INT,
                       "epoch": (int, NULL), "cursor": (int, NULL), "path": STR,
                       "state_lost": BOOL, "steps_lost": INT},
    "driver_resumed": {"resumed": BOOL, "outage_seconds": NUM},
    "stacks_dumped": {"slot": STR, "pid": INT, "seconds": NUM},
    "leading": {"store": STR, "standby": BOOL},
    "leadership_lost": {"reason": STR},
    "newcomer_started": {"slot": STR, "reason": STR},
    "newcomer_ready": {"slot": STR, "seconds": NUM},
    "newcomer_placed": {"slot": STR, "round": INT},
    "straggler": {"slot": STR, "rank": INT, "host": STR, "compute_seconds": NUM,
                  "wait_seconds": NUM, "median_seconds": NUM, "ratio": NUM, "window": INT,
                  "action": STR, "decision": STR, "reason": STR,
                  "steps_per_second_now": NUM, "steps_per_second_after": NUM},
    "straggler_cleared": {"slot": STR, "rank": INT, "host": STR, "compute_seconds": NUM,
                          "wait_seconds": NUM, "median_seconds": NUM, "ratio": NUM,
                          "window": INT},
    "progress": {"round": INT, "size": INT, "step": (int, NULL), "epoch": (int, NULL),
                 "samples": (int, NULL), "samples_per_second": (int, float, NULL),
                 "steps_per_second": (int, float, NULL)},
}


def check_event_schema(log, stragglers=False):
    """Every event of the log has its fields, of their types. Unless the test made one, no
    worker was named a straggler: a kill, a stop, a scale-up or a restart is not one."""
    for e in events(log):
        assert stragglers or e["event"] != "straggler", e
        assert isinstance(e["ts"], float) and e["event"] in EVENT_SCHEMA, e
        for field, kind in EVENT_SCHEMA[e["event"]].items():
            assert field in e and isinstance(e[field], kind), (field, e)
            if kind is INT or kind == (int, NULL):
                assert not isinstance(e[field], bool), (field, e)
        if "slot" in e:
            assert re.fullmatch(r"[^\s:]+:\d+", e["slot"]), e


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
    want = fault_free(elastic_run, example, *args)
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
