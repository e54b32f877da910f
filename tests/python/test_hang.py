"""Hung, stopped and silent workers (issue 10): the driver names the worker that holds its
round up, dumps its stacks into the job's log, kills it, and the survivors finish with the
fault-free model."""
import os

import pytest

import ledger
from helpers import PY, WORKERS, Job, events, pid_alive, py_env, py_fault_free, run


@pytest.mark.parametrize("how,hang_timeout,reason", [
    ("sleep", "3", "is not in a collective while its peers wait in one"),
    ("stop", "3", "is silent"),
    # The hang timeout far away: the broken Watch stream (--liveness-timeout 6) finds it.
    ("stop", "300", "its Watch stream broke"),
])
def test_a_hung_worker_is_named_dumped_and_killed_and_the_survivors_finish(
        elastic_run, tmp_path, how, hang_timeout, reason):
    want = py_fault_free(elastic_run, tmp_path, 4)
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--hang-timeout", hang_timeout,
               "--event-log", log, PY, os.path.join(WORKERS, "train_state.py"), "4", book,
               "--hang-at", "20", "--hang-how", how], env=py_env())
    try:
        hung_pid = int(job.wait_for(r"hanging pid (\d+)", timeout=120)[0].group(1))
        assert job.wait(timeout=180) == 0, job.text()
    finally:
        job.kill()
    out = job.text()
    assert f"final weights {want}" in out, out
    assert not pid_alive(hung_pid)
    hung = [e for e in events(log) if e["event"] == "worker_hung"]
    assert len(hung) == 1, hung
    assert hung[0]["slot"] == "localhost:2" and hung[0]["pid"] == hung_pid, hung
    assert hung[0]["rank"] == 2 and hung[0]["host"] == "localhost", hung
    # Named in one line, with its rank, slot, host and pid.
    assert f"worker 2 (slot localhost:2, host localhost, pid {hung_pid}, last step" in out, out
    # Its native stacks, and for a worker that still runs its Python stack (faulthandler).
    assert f"[2]<stderr>:[elastic-run] stacks of pid {hung_pid}" in out, out
    assert reason in hung[0]["reason"], hung
    if how == "sleep":
        assert 'train_state.py", line' in out, out
    problems = ledger.check(book, 512, 4, max_rollback=4)
    assert not problems, "\n".join(problems)


def test_a_slow_first_step_does_not_trip_the_default_timeout(elastic_run, tmp_path):
    # The first step takes 4 s, later ones 10 ms: the default timeout follows the job (at
    # least 60 s), so nothing is named hung.
    script = tmp_path / "slow_first.py"
    script.write_text("""
import time
import numpy as np
import elastic

state = elastic.ObjectState(step=0)


@elastic.run
def train(state):
    while state.step < 30:
        if state.step == 0:
            time.sleep(4)
        elastic.allreduce(np.ones(4))
        time.sleep(0.01)
        state.step += 1
        state.commit()


train(state)
""")
    log = str(tmp_path / "events.jsonl")
    rc, out = run([elastic_run, "-np", "2", "--event-log", log, PY, str(script)], timeout=120,
                  env=py_env())
    assert rc == 0, out
    assert not [e for e in events(log) if e["event"] in ("worker_hung", "round_hung")], out
