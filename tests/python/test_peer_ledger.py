"""bench/peers/peerledger.py, the judge of the peers benchmark (bench/peers/run.py): ledgers
made here line by line, as each kind of system writes them after each kind of fault, and what
the judge must find in them: samples trained twice or never in the final model's history, the
work rolled back, and the time from a fault to the next step of the re-formed job."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bench", "peers"))
import peerledger  # noqa: E402

SAMPLES, BATCH = 64, 16  # 4 steps per epoch


class Book:
    """Writes ledger files as the training scripts do: one per pid, one JSON line per step."""

    def __init__(self, tmp_path):
        (tmp_path / "ledger").mkdir()
        self.prefix = str(tmp_path / "ledger" / "book")

    def line(self, pid, t, epoch, step, rank, size, idx, raw=None):
        with open(f"{self.prefix}.{pid}", "a") as f:
            f.write(raw if raw is not None else json.dumps(
                {"t": t, "pid": pid, "epoch": epoch, "step": step, "rank": rank, "size": size,
                 "idx": list(idx)}) + "\n")

    def step(self, pids, t, epoch, step, batch):
        """Every process of `pids` (rank = position) writes its part of `batch`."""
        size = len(pids)
        per = len(batch) // size
        for rank, pid in enumerate(pids):
            self.line(pid, t + 0.001 * rank, epoch, step, rank, size,
                      batch[rank * per:(rank + 1) * per])

    def read(self):
        return peerledger.read(self.prefix)


def batch(epoch, b):
    order = list(range(SAMPLES)) if epoch % 2 == 0 else list(reversed(range(SAMPLES)))
    return order[b * BATCH:(b + 1) * BATCH]


def fault_free(book, pids=(1, 2, 3, 4), epochs=2, t=100.0, dt=0.05):
    step = 0
    for e in range(epochs):
        for b in range(SAMPLES // BATCH):
            step += 1
            book.step(list(pids), t, e, step, batch(e, b))
            t += dt
    return t


def test_a_fault_free_run_trains_every_sample_once(tmp_path):
    book = Book(tmp_path)
    fault_free(book)
    rows, bad = book.read()
    v = peerledger.judge(rows, SAMPLES, 2)
    assert bad == 0 and len(rows) == 2 * 4 * 4
    assert (v["steps"], v["twice"], v["never"], v["redone"], v["incomplete"]) == (8, 0, 0, 0, [])


def test_steps_rolled_back_and_trained_again_count_once_and_as_redone(tmp_path):
    """An in-process rollback (elastic-run, Horovod): steps 3 and 4 written at 4 workers, the
    job goes back to its commit after step 2 and trains them again at 3 workers."""
    book = Book(tmp_path)
    t = 100.0
    for step, b in ((1, 0), (2, 1), (3, 2), (4, 3)):
        book.step([1, 2, 3, 4], t, 0, step, batch(0, b))
        t += 0.05
    t += 1.0  # the recovery
    for step, b in ((3, 2), (4, 3)):
        book.step([1, 2, 3], t, 0, step, batch(0, b)[:15])  # 15: three equal parts
        t += 0.05
    rows, _ = book.read()
    v = peerledger.judge(rows, SAMPLES, 1)
    assert v["redone"] == 2 * BATCH  # the two steps' first attempts
    assert v["twice"] == 0
    assert v["never"] == 2  # batch(0, 2)[15] and batch(0, 3)[15] were left out above
    assert v["incomplete"] == []


def test_a_restart_from_an_epoch_checkpoint_trains_the_epoch_again_once(tmp_path):
    """torchrun: every worker restarted (new pids), back to the checkpoint of epoch 0's end."""
    book = Book(tmp_path)
    t = fault_free(book, epochs=1)
    book.step([1, 2, 3, 4], t, 1, 5, batch(1, 0))  # epoch 1, step 5; then the kill
    t += 3.0
    fault_free_epoch1 = [(5, 0), (6, 1), (7, 2), (8, 3)]
    for step, b in fault_free_epoch1:
        book.step([11, 12, 13, 14], t, 1, step, batch(1, b))
        t += 0.05
    rows, _ = book.read()
    v = peerledger.judge(rows, SAMPLES, 2)
    assert (v["twice"], v["never"], v["redone"], v["steps"]) == (0, 0, BATCH, 8)


def test_a_dead_replicas_share_is_never_trained(tmp_path):
    """TorchFT: each replica group trains its fixed quarter; with one gone the others commit
    their steps without its samples."""
    book = Book(tmp_path)
    t = 100.0
    for step, b in ((1, 0), (2, 1)):
        book.step([1, 2, 3, 4], t, 0, step, batch(0, b))
        t += 0.05
    for step, b in ((3, 2), (4, 3)):
        for rank, pid in enumerate([1, 2, 3]):
            book.line(pid, t + 0.001 * rank, 0, step, rank, 3, batch(0, b)[rank * 4:rank * 4 + 4])
        t += 0.05
    v = peerledger.judge(book.read()[0], SAMPLES, 1)
    assert (v["twice"], v["never"], v["redone"]) == (0, 8, 0)


def test_padding_with_repeated_samples_is_trained_twice(tmp_path):
    """Horovod's sampler pads a split to equal parts with samples already in it."""
    book = Book(tmp_path)
    fault_free(book, epochs=1)
    book.line(1, 200.0, 0, 5, 0, 1, [0, 1])  # a fifth step of epoch 0 repeating two samples
    v = peerledger.judge(book.read()[0], SAMPLES, 1)
    assert (v["twice"], v["extra"], v["never"]) == (2, 2, 0)
    assert v["epochs"][0]["twice"] == 2


def test_a_line_cut_short_by_a_kill_is_counted_not_fatal(tmp_path):
    book = Book(tmp_path)
    fault_free(book, epochs=1)
    book.line(4, 0, 0, 0, 0, 0, [], raw='{"t": 300.0, "pid": 4, "epo')
    rows, bad = book.read()
    assert bad == 1 and len(rows) == 16
    assert peerledger.judge(rows, SAMPLES, 1)["never"] == 0


def test_a_relaunched_worker_writing_first_joins_its_attempt_not_the_old_one(tmp_path):
    """After the recovery the new process (rank 3) writes the redone step before the
    survivors do: its line belongs to the new attempt, which alone counts."""
    book = Book(tmp_path)
    t = 100.0
    book.step([1, 2, 3, 4], t, 0, 1, batch(0, 0))
    book.line(1, t + 0.05, 0, 2, 0, 4, batch(0, 1)[0:4])  # step 2 under way at the kill
    book.line(2, t + 0.051, 0, 2, 1, 4, batch(0, 1)[4:8])
    t += 2.0
    b = batch(0, 1)
    book.line(9, t, 0, 2, 3, 4, b[12:16])
    for rank, pid in enumerate([1, 2, 3]):
        book.line(pid, t + 0.002 + 0.001 * rank, 0, 2, rank, 4, b[rank * 4:rank * 4 + 4])
    rows, _ = book.read()
    kept = peerledger.lineage(rows)
    assert sorted(r["pid"] for r in kept[2]) == [1, 2, 3, 9]
    v = peerledger.judge(rows, SAMPLES, 1)
    assert v["redone"] == 8 and v["incomplete"] == []


def test_an_incomplete_last_attempt_is_reported(tmp_path):
    book = Book(tmp_path)
    book.step([1, 2, 3, 4], 100.0, 0, 1, batch(0, 0))
    book.line(1, 100.1, 0, 2, 0, 4, batch(0, 1)[:4])
    v = peerledger.judge(book.read()[0], SAMPLES, 1)
    assert v["incomplete"] == [2]


def test_time_to_the_next_step_skips_steps_that_were_under_way(tmp_path):
    """A survivor finishing the step under way at the kill is not the job re-formed; the first
    line at the new size is."""
    book = Book(tmp_path)
    t = fault_free(book, epochs=1)  # steps 1-4 at 4 workers, until t
    t_fault = t
    book.line(1, t + 0.002, 1, 5, 0, 4, batch(1, 0)[:4])  # the step under way, finished
    book.line(2, t + 0.003, 1, 5, 1, 4, batch(1, 0)[4:8])  # and by another survivor
    book.step([1, 2, 3], t + 0.5, 1, 5, batch(1, 0)[:15])  # rolled back, at 3 workers
    book.step([1, 2, 3, 9], t + 2.0, 1, 6, batch(1, 1))  # back at 4 with a new process
    rows, _ = book.read()
    reformed, back = peerledger.after_fault(rows, t_fault, victim_pid=4, full_size=4)
    assert abs(reformed - (t + 0.5)) < 1e-6
    assert abs(back - (t + 2.0)) < 1e-6
    assert abs(peerledger.stall(rows, t_fault) - 1.5) < 0.01


def test_time_to_the_next_step_of_a_restarted_job(tmp_path):
    """torchrun: new pids at the old size; the step numbers go back to the checkpoint."""
    book = Book(tmp_path)
    t = fault_free(book, epochs=1)
    book.step([11, 12, 13, 14], t + 3.0, 0, 1, batch(0, 0))
    rows, _ = book.read()
    reformed, back = peerledger.after_fault(rows, t, victim_pid=4, full_size=4)
    assert abs(reformed - (t + 3.0)) < 1e-6 and reformed == back


def test_nothing_after_the_fault_is_none(tmp_path):
    book = Book(tmp_path)
    t = fault_free(book, epochs=1)
    rows, _ = book.read()
    assert peerledger.after_fault(rows, t, 4, 4) == (None, None)
    assert peerledger.stall(rows, t) is None
    assert peerledger.after_fault([], t, 4, 4) == (None, None)


def test_throughput_counts_samples_per_second(tmp_path):
    book = Book(tmp_path)
    fault_free(book, epochs=1, t=100.0, dt=0.5)  # 16 samples a step, every 0.5 s
    rows, _ = book.read()
    assert abs(peerledger.throughput(rows, 100.2, 101.7) - 3 * BATCH / 1.5) < 1e-6
