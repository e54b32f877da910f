"""The Python package `elastic` (python/), as a user gets it: installed into the Python
environment that runs the tests (scripts/test.sh installs it before pytest), and workers are plain
Python scripts under elastic-run. torch is imported only by the workers that need it."""
import os
import re
import signal
import subprocess

import pytest

import ledger
from helpers import PY, WORKERS, Job, events, py_env, py_fault_free, run, wait_gone, worker_pid


def test_the_package_imports_without_pythonpath():
    env = py_env()
    p = subprocess.run([PY, "-c", "import elastic, sys; print(elastic.__file__)"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "elastic" in p.stdout


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_every_collective_and_dtype_against_numpy(elastic_run, np_):
    rc, out = run([elastic_run, "-np", str(np_), PY, os.path.join(WORKERS, "api_worker.py")],
                  env=py_env(), timeout=180)
    assert rc == 0, out
    for r in range(np_):
        assert f"api ok rank {r} of {np_}" in out, out


def test_torch_tensors_every_dtype_including_bfloat16(elastic_run):
    rc, out = run([elastic_run, "-np", "2", PY, os.path.join(WORKERS, "api_worker.py"),
                   "--torch"], env=py_env(), timeout=180)
    assert rc == 0, out
    assert "api ok rank 1 of 2" in out, out


@pytest.mark.parametrize("warm_up", ["1", "0"])
def test_init_warms_torch_up_before_the_process_is_ready(elastic_run, warm_up):
    """A process that joins a running job is ready once init() reaches the driver, and its
    peers wait for it from then on: what torch's first optimizer imports (torch._dynamo with
    torch 2.x, about a second here) is imported before, in init(). With ELASTIC_WARM_UP=0 it
    is not (the check that the worker's count means something)."""
    env = dict(py_env(), ELASTIC_WARM_UP=warm_up)
    rc, out = run([elastic_run, "-np", "2", PY, os.path.join(WORKERS, "optimizer_warm_up.py")],
                  env=env, timeout=180)
    assert rc == 0, out
    counts = [int(c) for c in re.findall(r"the first optimizer imported (\d+) modules", out)]
    assert len(counts) == 2, out
    if warm_up == "1":
        assert counts == [0, 0], out
    else:
        assert min(counts) > 0, out


@pytest.mark.parametrize("np_", [2, 3])
def test_distributed_optimizer_buckets_give_every_rank_the_average_gradient(elastic_run, np_):
    """Tapered buckets whose gradients are views of one flat tensor each, reduced in place;
    gradients set to None and made anew go the fused way and are put back into the views."""
    rc, out = run([elastic_run, "-np", str(np_), PY,
                   os.path.join(WORKERS, "optimizer_buckets.py")], env=py_env(), timeout=180)
    assert rc == 0, out
    for r in range(np_):
        assert f"buckets ok rank {r} of {np_}" in out, out


def test_a_script_runs_under_plain_python3_as_a_job_of_size_1():
    p = subprocess.run([PY, os.path.join(WORKERS, "api_worker.py")], env=py_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "api ok rank 0 of 1" in p.stdout
    assert p.stderr.count("running as a job of size 1") == 1, p.stderr


def test_elastic_run_recovers_a_python_job_with_the_fault_free_model(elastic_run, tmp_path):
    want = py_fault_free(elastic_run, tmp_path, 6)
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--host-failure-limit", "0",
               "--event-log", log, PY, os.path.join(WORKERS, "train_state.py"), "6", book],
              env=py_env())
    try:
        job.wait_for(r"<stdout>:|round 0 formed", timeout=60)
        import time
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait for some training, by the ledger
            if len(ledger.read(book)) > 40:
                break
            time.sleep(0.05)
        os.kill(worker_pid(log, "localhost:0"), signal.SIGKILL)  # rank 0
        assert job.wait(timeout=180) == 0, job.text()
    finally:
        job.kill()
    assert f"final weights {want}" in job.text(), job.text()
    problems = ledger.check(book, 512, 6, max_rollback=4)
    assert not problems, "\n".join(problems)
    formed = [e for e in events(log) if e["event"] == "round_formed"]
    # The survivors re-form among themselves, then with the killed slot's newcomer, synced.
    assert len(formed) >= 2 and any(e["sync_required"] for e in formed[1:]), formed


@pytest.mark.parametrize("how", ["ok", "raise"])
def test_a_python_state_reports_its_progress_with_each_commit(elastic_run, tmp_path, how):
    log = str(tmp_path / "events.jsonl")
    rc, out = run([elastic_run, "-np", "2", "--event-log", log, PY,
                   os.path.join(WORKERS, "train_state.py"), "2", str(tmp_path / "l"),
                   "--progress", how], env=py_env(), timeout=120)
    assert rc == 0, out
    commits = [e for e in events(log) if e["event"] == "committed"]
    assert commits, out
    if how == "ok":
        assert all(e["epoch"] is not None and e["samples"] == e["epoch"] * 512 + e["cursor"]
                   for e in commits), commits
    else:  # a failing progress() never stops training: the commit reports the step only
        assert all(e["epoch"] is None and e["step"] > 0 for e in commits), commits
        assert out.count("state.progress() failed (ValueError: no progress today)") == 2, out


def test_a_user_exception_fails_the_job_with_its_traceback(elastic_run, tmp_path):
    rc, out = run([elastic_run, "-np", "2", PY, os.path.join(WORKERS, "train_state.py"), "2",
                   str(tmp_path / "l"), "--fail-at", "5"], env=py_env(), timeout=120)
    assert rc == 1, out
    assert "Traceback" in out and "a bug in the user's training code" in out, out
    assert "train_state.py" in out


def test_sigterm_to_elastic_run_leaves_no_python_worker(elastic_run, tmp_path):
    log = str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "-np", "2", "--event-log", log, PY,
               os.path.join(WORKERS, "train_state.py"), "1000", str(tmp_path / "l")],
              env=py_env())
    try:
        import time
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(ledger.read(str(tmp_path / "l"))) < 4:
            time.sleep(0.05)
        pids = [worker_pid(log, "localhost:0"), worker_pid(log, "localhost:1")]
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == 128 + signal.SIGTERM, job.text()
        assert wait_gone(pids) == []
    finally:
        job.kill()


def test_a_python_worker_that_leaves_is_re_formed_around(elastic_run, tmp_path):
    want = py_fault_free(elastic_run, tmp_path, 4)
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    rc, out = run([elastic_run, "-np", "3", "--min-np", "2", "--event-log", log, PY,
                   os.path.join(WORKERS, "train_state.py"), "4", book, "--leave-at", "10"],
                  env=py_env(), timeout=180)
    assert rc == 0, out
    assert f"final weights {want}" in out, out
    leaving = [e for e in events(log) if e["event"] == "worker_leaving"]
    assert leaving and leaving[0]["reason"] == "the test asked", events(log)
    assert not [e for e in events(log) if e["event"] == "worker_lost"]
    problems = ledger.check(book, 512, 4, max_rollback=4)
    assert not problems, "\n".join(problems)


UNEVEN_STOP = """
import numpy as np
import elastic

state = elastic.ObjectState(step=0)


@elastic.run
def train(state):
    # Wrong on purpose: rank 0 stops after step 3, the others would go on.
    stop_at = 3 if elastic.rank() == 0 else 1000
    while state.step < stop_at:
        elastic.allreduce(np.ones(4))
        state.step += 1
        state.commit()


train(state)
"""


def test_a_rank_that_stops_alone_ends_the_job_with_the_reason(elastic_run, tmp_path):
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_STOP)
    rc, out = run([elastic_run, "-np", "3", "--min-np", "1", PY, str(script)], timeout=120,
                  env=py_env())
    assert rc == 1, out
    assert "every rank must stop after the same step" in out
    assert "success" not in out


LOST_IN_BACKWARD = """
import os, signal, sys, time
import torch
import elastic
import elastic.torch as et

marker, layers = sys.argv[1], 8


class Slow(torch.autograd.Function):
    # Backward takes 0.5 s per layer: the step's backward lasts 4 s, far longer than the driver
    # needs to notice a dead peer and abort the round.
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Slow.calls += 1
        time.sleep(0.5)
        return g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x):
        for fc in self.fc:
            x = Slow.apply(fc(x))
        return x


torch.manual_seed(0)
model = Net()
# One bucket per layer (8 x 8 + 8 floats): the last layer's is reduced while backward goes on.
opt = et.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), bucket_bytes=64,
                              last_bucket_bytes=64)
state = et.TorchState(model=model, optimizer=opt, step=0)


@elastic.run
def train(state):
    while state.step < 3:
        opt.zero_grad()
        loss = model(torch.ones(4, 8)).sum()
        if state.step == 1 and elastic.rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        Slow.calls = 0
        try:
            loss.backward()
        except elastic.WorkerLostError:
            print(f"lost in backward after {Slow.calls} of {layers} layers", flush=True)
            raise
        print(f"backward done at step {state.step}, size {elastic.size()}", flush=True)
        opt.step()
        state.step += 1
        state.commit()


train(state)
print(f"rank {elastic.rank()} done at step {state.step}", flush=True)
"""


def test_a_lost_peer_ends_backward_early_and_the_step_is_redone(elastic_run, tmp_path):
    """DistributedOptimizer: once a bucket's reduction has failed (a peer was killed), the next
    gradient hook raises WorkerLostError out of loss.backward(), so the survivor stops computing
    a step that cannot complete; @elastic.run then re-forms and the step is redone."""
    script = tmp_path / "lost_in_backward.py"
    script.write_text(LOST_IN_BACKWARD)
    rc, out = run([elastic_run, "-np", "2", "--min-np", "1", PY, str(script),
                   str(tmp_path / "killed")], timeout=180, env=py_env())
    assert rc == 0, out
    lost = [line for line in out.splitlines() if "lost in backward after" in line]
    assert len(lost) == 1, out
    done = int(lost[0].split("lost in backward after ")[1].split()[0])
    assert done < 8, out  # without the early end, backward ran all 8 layers and step() raised
    assert "rank 0 done at step 3" in out, out
    assert "backward done at step 1, size 1" in out, out


SCALED_AWAY = """
import atexit, os, sys, time
import numpy as np
import elastic

hosts = sys.argv[1]
atexit.register(lambda: print(f"atexit ran in slot {elastic.slot()}", flush=True))
state = elastic.ObjectState(step=0)


@elastic.run
def train(state):
    # Until the job is down to 2 (bounded: 3000 steps of 10 ms), and 40 steps.
    while state.step < 40 or (elastic.size() == 3 and state.step < 3000):
        elastic.allreduce(np.ones(4))
        time.sleep(0.01)
        state.step += 1
        if state.step == 5 and elastic.rank() == 0:
            with open(hosts, "w") as f:
                f.write("localhost:2\\n")  # the discovery now gives 2 slots: one goes
        state.commit()


try:
    train(state)
except SystemExit as e:
    print(f"SystemExit({e.code}) in slot {elastic.slot()}", flush=True)
    raise
print(f"done in slot {elastic.slot()} with {elastic.size()}", flush=True)
"""


def test_a_python_worker_scaled_away_gets_systemexit_0_and_its_atexit_runs(elastic_run,
                                                                          tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:3\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    script = tmp_path / "scaled_away.py"
    script.write_text(SCALED_AWAY)
    rc, out = run([elastic_run, "--min-np", "1", "--max-np", "3", "--host-discovery-script",
                   str(discover), PY, str(script), str(hosts)], timeout=180, env=py_env())
    assert rc == 0, out
    assert "SystemExit(0) in slot localhost:2" in out, out
    for slot in range(3):
        assert f"atexit ran in slot localhost:{slot}" in out, out
    assert "done in slot localhost:0 with 2" in out, out


LOST_IN_THE_COMMIT = """
import sys
import numpy as np
import elastic


class Counted(elastic.ObjectState):
    restores = 0

    def restore(self):
        Counted.restores += 1
        elastic.ObjectState.restore(self)


state = Counted(step=0, w=np.zeros(4))


@elastic.run
def train(state):
    while state.step < 8:
        state.w = state.w + elastic.allreduce(np.full(4, state.step + 1.0), op=elastic.Sum)
        state.step += 1
        state.commit()


train(state)
print(f"rank {elastic.rank()}: restores {Counted.restores}, w {state.w.tolist()}, "
      f"size {elastic.size()}", flush=True)
"""


def test_a_peer_lost_in_the_commits_agreement_needs_no_copy_back(elastic_run, tmp_path):
    """Rank 1 is killed right after its save of version 3 (test hook), so rank 0's commit of
    version 3 fails in its agreement: rank 0's values are version 3 exactly, so @elastic.run
    rolls back without calling restore(), and the job's result is what it must be."""
    script = tmp_path / "lost_in_commit.py"
    script.write_text(LOST_IN_THE_COMMIT)
    env = dict(py_env(), ELASTIC_TEST_HOOKS="after_save@localhost:1@0@3=kill")
    rc, out = run([elastic_run, "-np", "2", "--min-np", "1", PY, str(script)], timeout=180,
                  env=env)
    assert rc == 0, out
    # Steps 1-3 on 2 ranks (sums 2, 4, 6), steps 4-8 on rank 0 alone (4 ... 8): 42.
    assert "rank 0: restores 0, w [42.0, 42.0, 42.0, 42.0], size 1" in out, out
    assert "which the interrupted commit had saved" in out, out
