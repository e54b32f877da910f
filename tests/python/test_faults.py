"""Deterministic regression tests for the races a random-fault soak found (issue 7): each kills
or fails a worker at an exact point of the protocol through the worker library's test hooks
(ELASTIC_TEST_HOOKS, docs/testing.md) and checks the promise: exit 0, the fault-free model bit
for bit, every sample of every epoch consumed by exactly one committed step, no silent
restart."""
import os
import signal

import pytest

import ledger
from helpers import Job, check_event_schema, events, run, wait_event, worker_pid

ARGS = ["--epochs", "8", "--step-ms", "5", "--commit-every", "4"]


@pytest.fixture(scope="module")
def example(build_dir):
    return str(build_dir / "examples" / "logistic_regression")


_HASHES = {}


def fault_free_hash(elastic_run, example, args):
    key = tuple(args)
    if key not in _HASHES:
        rc, out = run([elastic_run, "-np", "2", example] + list(args))
        assert rc == 0, out
        _HASHES[key] = ledger.final_hash(out)
    return _HASHES[key]


@pytest.fixture(scope="module")
def want(elastic_run, example):
    return fault_free_hash(elastic_run, example, ARGS)


def hooks_env(spec):
    env = dict(os.environ)
    env["ELASTIC_TEST_HOOKS"] = spec
    return env


def check_promise(job, book, want, commit_every=4, epochs=8):
    assert job.wait(timeout=180) == 0, job.text()
    assert ledger.final_hash(job.text()) == want, job.text()
    problems = ledger.check(book, 4096, epochs, max_rollback=commit_every + 1)
    assert not problems, "\n".join(problems)


def formed(log):
    return [e for e in events(log) if e["event"] == "round_formed"]


def test_a_step_committed_on_some_ranks_only_is_synced_from_a_holder(
        elastic_run, example, want, tmp_path):
    """Commit 6: ranks 1 fails as if its gradient allreduce had lost the dying peer (it rolls
    back to version 5), rank 3 dies, ranks 0 and 2 commit version 6 and then fail in the
    commit's agreement. The survivors hold versions 6, 5, 6: the next round must sync them
    from a holder of 6 (before: no sync, ranks a step apart, samples lost and repeated)."""
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    spec = ("before_save@localhost:1@0@6=lost;"
            "after_save@localhost:3@0@6=kill")
    job = Job([elastic_run, "-np", "4", "--min-np", "2", "--host-failure-limit", "0",
               "--event-log", log, example] + ARGS + ["--ledger", book], env=hooks_env(spec))
    try:
        check_promise(job, book, want)
    finally:
        job.kill()
    split = [e for e in formed(log) if len(set(e["versions"]) - {0}) > 1]
    assert split, formed(log)
    assert split[0]["version"] == 6 and split[0]["sync_required"], split[0]
    assert "test hook before_save fired: lost" in job.text()


def test_rank_0_killed_while_it_syncs_a_newcomer_does_not_restart_training(
        elastic_run, example, want, tmp_path):
    """Slot 1 dies at commit 3 and comes back as a newcomer; in the round that takes it in
    (round 2: round 1 is the survivors', or it is replaced by round 2 before it forms) rank 0
    (slot 0) dies while it sends the state. The newcomer holds nothing, so the next rank 0 must
    be slot 2, which holds what slot 0 was sending (before: the newcomer became rank 0 and
    training silently restarted from step 0)."""
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    spec = ("before_save@localhost:1@0@3=kill;"
            "sync_root@localhost:0@2@*=kill")
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--host-failure-limit", "0",
               "--event-log", log, example] + ARGS + ["--ledger", book], env=hooks_env(spec))
    try:
        check_promise(job, book, want)
    finally:
        job.kill()
    rounds = formed(log)
    synced = [r for r in rounds if r["round"] == 2]
    assert synced and synced[0]["members"][0] == "localhost:0", rounds
    assert synced[0]["sync_required"] and "localhost:1" in synced[0]["members"], rounds
    after = [r for r in rounds if r["round"] >= 3]
    assert after and after[0]["members"][0] == "localhost:2", rounds
    assert after[0]["version"] == synced[0]["version"] >= 3, after[0]
    assert "test hook sync_root fired: kill" in job.text()
    assert not [e for e in events(log) if e["event"] == "state_lost"]


@pytest.mark.parametrize("start_over", [False, True])
def test_every_holder_gone_is_state_lost_never_a_silent_restart(
        elastic_run, example, want, tmp_path, start_over):
    """Both workers die right after commit 3: the relaunched ones hold nothing. The job says
    so and fails, or starts over when asked to."""
    log = str(tmp_path / "events.jsonl")
    spec = "after_save@*@0@3=kill"
    extra = ["--start-over-if-state-lost"] if start_over else []
    job = Job([elastic_run, "-np", "2", "--min-np", "1", "--host-failure-limit", "0",
               "--event-log", log] + extra + [example] + ARGS, env=hooks_env(spec))
    try:
        rc = job.wait(timeout=180)
    finally:
        job.kill()
    lost = [e for e in events(log) if e["event"] == "state_lost"]
    assert lost and lost[0]["newest_committed"] >= 1, events(log)[-5:]
    if start_over:
        assert rc == 0, job.text()
        assert lost[0]["start_over"] is True
        assert ledger.final_hash(job.text()) == want
    else:
        assert rc == 1, job.text()
        assert "state lost" in job.text() and "--start-over-if-state-lost" in job.text()


@pytest.mark.parametrize("how", ["exit 0", "exit 3", "killed"])
def test_a_leaving_worker_is_re_formed_around_at_once(elastic_run, example, want, tmp_path,
                                                      how):
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    code = {"exit 0": "0", "exit 3": "3", "killed": "-1"}[how]
    args = ["--epochs", "8", "--step-ms", "5", "--commit-every", "4"]
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--rendezvous-timeout", "600",
               "--event-log", log, example] + args + ["--ledger", book, "--leave-exit", code])
    try:
        job.wait_for(r"epoch 0 done")
        os.kill(worker_pid(log, "localhost:2"), signal.SIGUSR1)
        wait_event(log, lambda e: e["event"] == "worker_leaving" and e["slot"] == "localhost:2")
        if how == "killed":
            os.kill(worker_pid(log, "localhost:2"), signal.SIGKILL)
        # The round forms without the leaver; no wait on --rendezvous-timeout (600 s).
        wait_event(log, lambda e: e["event"] == "round_formed"
                   and e["members"] == ["localhost:0", "localhost:1"], timeout=30)
        check_promise(job, book, want)
    finally:
        job.kill()
    assert not [e for e in events(log) if e["event"] == "worker_lost"]


def test_a_slot_that_left_and_was_relaunched_is_a_member_like_any_other(
        elastic_run, example, tmp_path):
    """Found by the soak: a relaunched slot kept its predecessor's "leaving" mark, so a later
    scale-down never told it to go and it waited in Join until the job ended."""
    from helpers import Discovery
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    disc = Discovery(tmp_path, "localhost:3")
    args = ["--epochs", "20", "--step-ms", "5", "--commit-every", "4"]
    want = fault_free_hash(elastic_run, example, args)
    job = Job([elastic_run, "--min-np", "2", "--host-discovery-script", str(disc.script),
               "--event-log", log, example] + args + ["--ledger", book])
    try:
        job.wait_for(r"epoch 0 done")
        os.kill(worker_pid(log, "localhost:2"), signal.SIGUSR1)
        wait_event(log, lambda e: e["event"] == "worker_exited" and e["slot"] == "localhost:2")
        disc.set("localhost:4")  # a change: slots 2 and 3 start
        wait_event(log, lambda e: e["event"] == "round_formed" and len(e["members"]) == 4)
        disc.set("localhost:2")  # slots 2 and 3 go
        wait_event(log, lambda e: e["event"] == "round_formed" and len(e["members"]) == 2)
        check_promise(job, book, want, epochs=20)
    finally:
        job.kill()
    exits = [e for e in events(log) if e["event"] == "worker_exited"]
    assert all(e["code"] == 0 for e in exits), exits


# Where a round's first collective waits for every rank, on one host: the Gloo pairs connecting
# (with ELASTIC_SHM_COLLECTIVES=0, at the state sync's broadcast), or the shared-memory
# broadcast of that sync (the default: those rounds connect no pairs).
FIRST_WAIT = [pytest.param("connect", {"ELASTIC_SHM_COLLECTIVES": "0"}, id="pairs"),
              pytest.param("shm_broadcast", {}, id="shm")]


@pytest.mark.parametrize("hook,extra", FIRST_WAIT)
def test_a_newcomer_killed_while_the_mesh_connects_does_not_strand_its_peers(
        elastic_run, example, want, tmp_path, hook, extra):
    """The newcomer (slot 3) dies in round 1 right before the others wait for it (after it
    published its pair addresses, or before the sync's first barrier): the members that wait
    for it are stuck until the driver's ABORT (or the dead pid) reaches them there. They must
    be back in Join within the 10 s rendezvous timeout (Gloo's own connect timeout is 60 s),
    so the next round forms with every survivor."""
    from helpers import Discovery
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    disc = Discovery(tmp_path, "localhost:3")
    job = Job([elastic_run, "--min-np", "2", "--host-discovery-script", str(disc.script),
               "--host-failure-limit", "0", "--rendezvous-timeout", "10", "--event-log", log,
               example] + ARGS + ["--ledger", book],
              env=dict(hooks_env(f"{hook}@localhost:3@1@*=kill"), **extra))
    try:
        job.wait_for(r"epoch 0 done")
        disc.set("localhost:4")
        check_promise(job, book, want)
    finally:
        job.kill()
    assert f"test hook {hook} fired: kill" in job.text()
    assert "did not join" not in job.text(), job.text()
    rounds = formed(log)
    assert any(len(r["members"]) == 4 for r in rounds[2:]), rounds


@pytest.mark.parametrize("hook,extra", FIRST_WAIT)
def test_a_member_that_leaves_its_round_on_its_own_gets_its_peers_aborted(
        elastic_run, example, want, tmp_path, hook, extra):
    """Found by the soak: slot 1's mesh fails to connect in round 0 (here: a test hook throws
    right after it published its address, or before the sync's first barrier) and it joins
    again; peers that wait for it would wait out Gloo's 60 s connect timeout (or the
    collective timeout), and no new round was ever proposed. Its Join tells the driver it left
    the round: the others are aborted and re-form at once."""
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    job = Job([elastic_run, "-np", "4", "--min-np", "2", "--rendezvous-timeout", "10",
               "--event-log", log, example] + ARGS + ["--ledger", book],
              env=dict(hooks_env(f"{hook}@localhost:1@0@*=lost"), **extra))
    try:
        check_promise(job, book, want)
    finally:
        job.kill()
    assert f"test hook {hook} fired: lost" in job.text()
    assert "did not join" not in job.text(), job.text()
    # Slot 1, or a peer whose connect to it was refused once slot 1 closed its sockets,
    # is the first to join again: either way round 0 is left and re-formed.
    left = [e for e in events(log) if e["event"] == "member_left"]
    assert left and left[0]["round"] == 0, events(log)


def shm_segments():
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("elastic-")}
    except FileNotFoundError:
        return set()


@pytest.mark.parametrize("slot", ["localhost:0", "localhost:2"])
def test_a_local_rank_killed_inside_the_shared_memory_allreduce(
        elastic_run, example, want, tmp_path, slot):
    """Four workers of one host allreduce through shared memory. One dies between a chunk's
    copy-in and its reduction, while the other three wait for it in the segment's barrier:
    local rank 0 (the segment's creator) or local rank 2. The survivors must stop waiting (the
    driver's abort, or the dead pid), recover, and finish with the fault-free model; nothing
    may be left in /dev/shm."""
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    before = shm_segments()
    job = Job([elastic_run, "-np", "4", "--min-np", "2", "--host-failure-limit", "0",
               "--event-log", log, example] + ARGS + ["--ledger", book],
              env=hooks_env(f"shm_reduce@{slot}@0@40=kill"))
    try:
        check_promise(job, book, want)
    finally:
        job.kill()
    assert "test hook shm_reduce fired: kill" in job.text()
    assert len(formed(log)) >= 2, formed(log)
    assert shm_segments() - before == set()


def test_a_warm_spare_takes_the_place_of_a_lost_worker(elastic_run, example, want, tmp_path):
    """--spares 1: a fourth process starts on a free slot (the default localhost gets -np + 1
    slots) and waits, initialised. When a member dies, the spare takes its place in the next
    round (no new process is started for it), is synced from rank 0, and a new spare starts
    on the dead member's slot. The promise holds, and the spares are stopped at the end."""
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--spares", "1",
               "--host-failure-limit", "0", "--event-log", log, example] + ARGS +
              ["--ledger", book], env=hooks_env("before_save@localhost:1@0@6=kill"))
    try:
        check_promise(job, book, want)
    finally:
        job.kill()
    ev = events(log)
    started = [e for e in ev if e["event"] == "worker_started"]
    assert [e["slot"] for e in started if e["spare"]][:2] == ["localhost:3", "localhost:1"], ev
    promoted = [e for e in ev if e["event"] == "spare_promoted"]
    assert [e["slot"] for e in promoted] == ["localhost:3"], ev
    rounds = formed(log)
    assert rounds[0]["members"] == ["localhost:0", "localhost:1", "localhost:2"], rounds
    assert sorted(rounds[1]["members"]) == ["localhost:0", "localhost:2", "localhost:3"], rounds
    # No member process was started after round 0 (the place was the spare's).
    assert not [e for e in started[4:] if not e["spare"]], started
    assert "slot localhost:3: initialised, waiting for a place" in job.text()
    check_event_schema(log)
    assert job.wait(timeout=1) == 0


def test_a_removed_host_that_alone_holds_the_state_hands_it_over_first(
        elastic_run, example, tmp_path):
    """Found by the soak (seed 609133795): discovery swapped the only host that held the state
    for a new one. Its worker was removed at once, the new round held nothing and the job
    ended with "state lost". It must stay one round, sync the newcomers, and then go."""
    from helpers import Discovery
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    disc = Discovery(tmp_path, "localhost:2")
    args = ["--epochs", "20", "--step-ms", "5", "--commit-every", "4"]
    want = fault_free_hash(elastic_run, example, args)
    job = Job([elastic_run, "--min-np", "1", "--host-discovery-script", str(disc.script),
               "--event-log", log, example] + args + ["--ledger", book])
    try:
        job.wait_for(r"epoch 0 done")
        disc.set("127.0.0.1:2")  # every holder's host goes, in the same change new ones come
        check_promise(job, book, want, epochs=20)
    finally:
        job.kill()
    kept = [e for e in events(log) if e["event"] == "holder_kept"]
    assert kept and kept[0]["slot"].startswith("localhost:"), events(log)[-10:]
    assert not [e for e in events(log) if e["event"] == "state_lost"]
    last = formed(log)[-1]
    assert all(m.startswith("127.0.0.1:") for m in last["members"]), last
    check_event_schema(log)
