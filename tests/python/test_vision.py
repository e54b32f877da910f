"""examples/train_vision.py (a torchvision ResNet on synthetic images; elastic.torch's
TorchState, ElasticSampler and DistributedOptimizer) under elastic-run: a worker killed while
the job trains, its slot relaunched as a newcomer that the survivors take in at a commit once
it is ready; every sample trained exactly once by the workers' own ledgers."""
import os
import signal
import time

import ledger
from helpers import PY, Job, events, py_env, wait_event, worker_pid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_vision.py")
IMAGES, EPOCHS = 192, 6


def test_a_resnet_job_survives_a_kill_and_takes_the_relaunched_worker_back(elastic_run,
                                                                           tmp_path):
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--host-failure-limit", "0",
               "--event-log", log, PY, EXAMPLE, "--model", "resnet18", "--image", "32",
               "--images", str(IMAGES), "--global-batch", "12", "--epochs", str(EPOCHS),
               "--commit-every", "2", "--ledger", book], env=py_env())
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # some training first, by the ledger
            if len({(l.epoch, l.step) for l in ledger.read(book)}) >= 8:
                break
            time.sleep(0.1)
        victim = worker_pid(log, "localhost:1")
        os.kill(victim, signal.SIGKILL)
        # The survivors re-form without it at once; a newcomer starts for the slot and the job
        # is back at 3 once it is ready.
        placed = wait_event(log, lambda e: e["event"] == "newcomer_placed"
                            and e["slot"] == "localhost:1", timeout=180)
        wait_event(log, lambda e: e["event"] == "round_formed" and e["round"] == placed["round"]
                   and len(e["members"]) == 3, timeout=120)
        assert job.wait(timeout=300) == 0, job.text()
    finally:
        job.kill()
    assert "final: resnet18" in job.text(), job.text()
    formed = [e for e in events(log) if e["event"] == "round_formed"]
    sizes = [len(e["members"]) for e in formed]
    assert 2 in sizes and sizes[-1] == 3, sizes
    problems = ledger.check(book, IMAGES, EPOCHS, max_rollback=2)
    assert not problems, "\n".join(problems)
