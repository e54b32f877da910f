"""Stragglers (docs/recovery.md "Stragglers"): a worker whose CPU is throttled by a cgroup
quota mid-training, one of four, is named (a `straggler` event, a warning, `elastic-run
status`, /metrics) and nothing else changes: the job ends with the fault-free model and every
sample once. The straggler is made from outside the product, as a slow machine would be: the
example computes a fixed amount of CPU time a step (--work-ms), and the test moves one worker
into a cgroup with a twentieth of a CPU. The oracles are the workers' ledgers and the model's
hash; the event is what is checked of the driver."""
import json
import os
import re
import time
import urllib.request

import pytest

from cgroup import Throttle
from helpers import Job, check_event_schema, events, run, wait_event
import ledger

EPOCHS = 14
SAMPLES = 4096


def pid_of(log, slot):
    e = wait_event(log, lambda e: e["event"] == "worker_started" and e["slot"] == slot)
    return e["pid"]


def test_a_throttled_worker_is_named_a_straggler_and_the_job_is_untouched(
        elastic_run, example, fault_free_hash, tmp_path):
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    job_file = str(tmp_path / "job.json")
    # A twentieth of a CPU: a straggler however busy the machine's cores are with other work.
    # With a quarter, its peers, each sharing two cores busy with something else, were hardly
    # faster than it, and rightly none was named (CI, 2026-12-06; fails so under two busy
    # loops). Released once checked, so that the rest of the job is not 20x slower.
    try:
        throttle = Throttle(f"elastic-straggler-{os.getpid()}", 0.05)
    except RuntimeError as e:
        pytest.skip(str(e))
    job = Job([elastic_run, "-np", "4", "--event-log", log, "--job-file", job_file,
               "--metrics-port", "0", example, "--epochs", str(EPOCHS), "--work-ms", "3",
               "--ledger", book])
    try:
        job.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        # Not named while all four run at the same speed.
        assert not [e for e in events(log) if e["event"] == "straggler"], job.text()
        throttled_at = time.time()
        throttle.add(pid_of(log, "localhost:2"))
        named = wait_event(log, lambda e: e["event"] == "straggler", timeout=60)
        # Named within the window: 20 commits, at most a few seconds at the throttled pace.
        assert named["ts"] - throttled_at < 20, (named, throttled_at)
        assert named["slot"] == "localhost:2" and named["rank"] == 2, named
        assert named["ratio"] >= 1.5 and named["compute_seconds"] > named["median_seconds"]
        assert named["action"] == "warn" and named["window"] == 20, named
        assert named["decision"] == "none" and named["reason"] == "named only", named
        job.wait_for(r"worker 2 \(slot localhost:2, host localhost\) is a straggler", timeout=10)
        # elastic-run status and /metrics show it while the job runs (at the throttled
        # pace, for several seconds more).
        rc, out = run([elastic_run, "status", "--job-file", job_file, "--json"], timeout=30)
        assert rc == 0, out
        status = json.loads(out)
        assert status["stragglers"] == 1, status
        flagged = [m["slot"] for m in status["members"] if m["straggler"]]
        assert flagged == ["localhost:2"], status
        slow = [m for m in status["members"] if m["slot"] == "localhost:2"][0]
        assert slow["compute_seconds_per_step"] > 0, status
        rc, out = run([elastic_run, "status", "--job-file", job_file], timeout=30)
        assert rc == 0 and "straggler(s) now: localhost:2" in out, out
        port = int(job.wait_for(r"metrics on http://[^:]+:(\d+)/metrics", timeout=10)[0]
                   .group(1))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = text.decode()
        assert "elastic_stragglers_total 1" in text, text
        assert re.search(r'elastic_step_seconds\{slot="localhost:2",part="compute"\} [0-9.e-]+',
                         text), text
        throttle.close()
        assert job.wait(timeout=240) == 0, job.text()
    finally:
        job.kill()
        throttle.close()
    assert f"hash {fault_free_hash}" in job.text(), job.text()
    problems = ledger.check(book, SAMPLES, EPOCHS, max_rollback=0)
    assert not problems, "\n".join(problems)
    check_event_schema(log, stragglers=True)
    evs = events(log)
    assert len([e for e in evs if e["event"] == "straggler"]) == 1, evs
    assert len([e for e in evs if e["event"] == "round_formed"]) == 1  # nothing else changed


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("action", ["replace", "drop"])
def test_a_straggler_is_replaced_or_dropped_and_the_job_ends_as_a_fault_free_one(
        elastic_run, example, fault_free_hash, tmp_path, action):
    """replace: with a warm spare, the next round goes without the straggler and the spare
    takes its place; its host counts a failure (here, the first: blacklisted). drop: the job
    shrinks to three, faster than four waiting for one at a twentieth of a CPU (a quarter was
    no straggler next to peers sharing cores busy with other work). Either way the
    straggler's process leaves at a commit, and the model and the ledger are a fault-free
    run's."""
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    try:
        throttle = Throttle(f"elastic-straggler-{action}-{os.getpid()}", 0.05)
    except RuntimeError as e:
        pytest.skip(str(e))
    extra = ["--min-np", "2"] + (["--spares", "1"] if action == "replace" else [])
    job = Job([elastic_run, "-np", "4", "--event-log", log, "--straggler-action", action] +
              extra + [example, "--epochs", str(EPOCHS), "--work-ms", "3", "--ledger", book])
    try:
        job.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        slow = pid_of(log, "localhost:2")
        throttle.add(slow)
        named = wait_event(log, lambda e: e["event"] == "straggler", timeout=60)
        assert named["slot"] == "localhost:2" and named["decision"] == action, named
        assert named["steps_per_second_after"] > named["steps_per_second_now"], named
        formed = wait_event(log, lambda e: e["event"] == "round_formed" and e["round"] == 1,
                            timeout=60)
        assert "localhost:2" not in formed["members"], formed
        assert len(formed["members"]) == (4 if action == "replace" else 3), formed
        deadline = time.monotonic() + 30
        while pid_alive(slow):  # it leaves at its commit, as a scaled-away member does
            assert time.monotonic() < deadline, "the straggler did not leave"
            time.sleep(0.1)
        assert job.wait(timeout=240) == 0, job.text()
    finally:
        job.kill()
        throttle.close()
    assert f"hash {fault_free_hash}" in job.text(), job.text()
    problems = ledger.check(book, SAMPLES, EPOCHS, max_rollback=5)
    assert not problems, "\n".join(problems)
    check_event_schema(log, stragglers=True)
    evs = events(log)
    if action == "replace":
        assert [e["slot"] for e in evs if e["event"] == "spare_promoted"] == ["localhost:4"]
        assert [e["host"] for e in evs if e["event"] == "host_blacklisted"] == ["localhost"]
    assert len([e for e in evs if e["event"] == "straggler"]) == 1, evs


def test_equal_workers_name_no_straggler(elastic_run, example, fault_free_hash, tmp_path):
    """Four workers on two cores, one of them rank 0 with its extra work (printing, the
    final loss): none is named."""
    log = str(tmp_path / "events.jsonl")
    rc, out = run([elastic_run, "-np", "4", "--event-log", log, example, "--epochs",
                   str(EPOCHS), "--work-ms", "2"], timeout=240)
    assert rc == 0, out
    assert f"hash {fault_free_hash}" in out
    assert not [e for e in events(log) if e["event"] in ("straggler", "straggler_cleared")]
    assert "straggler" not in out


def test_a_throttled_pytorch_worker_is_named_a_straggler(elastic_run, tmp_path):
    """PyTorch workers (examples/train_digits.py: DistributedOptimizer's background
    allreduces beside the training thread), one of four throttled: it is named, and nothing
    else changes (the job ends as it would have)."""
    from helpers import PY, py_env
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_digits.py")
    log = str(tmp_path / "events.jsonl")
    try:
        # 5 % of a CPU: with torch 2.15 a step of this model is ~3 ms of CPU, which 15 % (15 ms
        # per 100 ms period) barely slowed; the job ended before the window filled (CI, once).
        throttle = Throttle(f"elastic-straggler-torch-{os.getpid()}", 0.05)
    except RuntimeError as e:
        pytest.skip(str(e))
    job = Job([elastic_run, "-np", "4", "--event-log", log, PY, example, "--epochs", "10",
               "--hidden", "1024"], env=py_env())
    try:
        job.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=120)
        throttle.add(pid_of(log, "localhost:2"))
        named = wait_event(log, lambda e: e["event"] == "straggler", timeout=60)
        assert named["slot"] == "localhost:2" and named["ratio"] >= 1.5, named
        assert job.wait(timeout=240) == 0, job.text()
    finally:
        job.kill()
        throttle.close()
    assert "final: 240 steps" in job.text(), job.text()
    check_event_schema(log, stragglers=True)
    assert len([e for e in events(log) if e["event"] == "round_formed"]) == 1
