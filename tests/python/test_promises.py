"""Promises the product makes in every run, each pinned by a test that fails without its fix
(issue 46): Horovod's reset-limit scenario, and a finished job's final checkpoint."""
import json
import os
import re

import ledger
from helpers import PY, WORKERS, Discovery, Job, cpp_fault_free, events, py_env, run, wait_event


def test_horovods_reset_limit_scenario_grows_to_4_and_shrinks_to_3_within_2_resets(
        elastic_run, build_dir, tmp_path):
    """Horovod's reset-limit scenario: discovery grows a 2-worker job to 4, then shrinks it to
    3; --reset-limit 2 must let it finish. The new process of slot localhost:3 takes 2 s longer
    to start than localhost:2's (as imports of torch vary): each arrival used to count as a
    reset of its own, and the shrink was then the third."""
    example = str(build_dir / "examples" / "logistic_regression")
    args = ["--epochs", "30", "--step-ms", "10"]
    want = cpp_fault_free(elastic_run, example, *args)
    disc = Discovery(tmp_path, "localhost:2")
    slow = tmp_path / "slow_start.sh"
    slow.write_text('#!/bin/sh\n[ "$ELASTIC_SLOT" = localhost:3 ] && sleep 2\nexec "$@"\n')
    slow.chmod(0o755)
    log = str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "--min-np", "2", "--max-np", "4", "--reset-limit", "2",
               "--host-discovery-script", str(disc.script), "--event-log", log, str(slow),
               example] + args)
    try:
        wait_event(log, lambda e: e["event"] == "round_formed")
        disc.set("localhost:4")
        grown = wait_event(log, lambda e: e["event"] == "round_formed" and len(e["members"]) == 4)
        disc.set("localhost:3")
        wait_event(log, lambda e: e["event"] == "round_formed" and e["ts"] > grown["ts"]
                   and len(e["members"]) == 3)
        assert job.wait(timeout=180) == 0, job.text()
    finally:
        job.kill()
    assert "reset limit" not in job.text(), job.text()
    assert want in job.text(), job.text()
    # Both new processes joined in one round (--newcomer-window): 2 -> 4, never 3 on the way.
    sizes = [len(e["members"]) for e in events(log) if e["event"] == "round_formed"]
    assert sizes[:2] == [2, 4], sizes


def newest_manifest(folder):
    versions = sorted(p for p in os.listdir(folder) if p.startswith("v"))
    assert versions, os.listdir(folder)
    with open(os.path.join(folder, versions[-1], "manifest.json")) as f:
        return json.load(f)


def test_a_finished_job_checkpoints_its_final_state_and_a_rerun_trains_nothing(
        elastic_run, tmp_path):
    """With --checkpoint-dir, a clean finish writes the final state as the newest checkpoint
    before the job reports success (the newest used to be the last periodic one, up to
    --checkpoint-interval stale, and the same command started again trained the tail again).
    Started again, the same command says the job is already complete and trains nothing;
    asked for more epochs, it goes on from the final state to the fault-free model."""
    folder = tmp_path / "ckpt"
    # One periodic checkpoint (at the first commit), then none for an hour: only the final
    # write can put the end of training in the folder.
    def command(epochs, book):
        return [elastic_run, "-np", "2", "--checkpoint-dir", str(folder),
                "--checkpoint-interval", "3600", PY, os.path.join(WORKERS, "train_state.py"),
                str(epochs), str(book), "--progress", "ok"]
    rc, first = run(command(3, tmp_path / "l1"), env=py_env(), timeout=180)
    assert rc == 0, first
    m = newest_manifest(folder)
    assert (m["epoch"], m["cursor"]) == (3, 0), m  # the end of epoch 3 of 3
    assert re.search(r"final checkpoint: version \d+ .* written in [0-9.]+ s", first), first
    assert f"the final state is checkpoint version {m['version']}" in first, first
    trained = first.split("final weights ")[1].split()[0]

    rc, again = run(command(3, tmp_path / "l2"), env=py_env(), timeout=180)
    assert rc == 0, again
    assert "the job was already complete" in again, again
    assert ledger.read(str(tmp_path / "l2")) == [], again  # not one step trained
    assert f"final weights {trained}" in again, again

    # Asked for a fourth epoch: it trains that epoch alone, from the final state, and ends
    # with the model of an uninterrupted 4-epoch run (exact: fixed-point sums).
    rc, ff = run([elastic_run, "-np", "2", PY, os.path.join(WORKERS, "train_state.py"), "4",
                  str(tmp_path / "ff")], env=py_env(), timeout=180)
    assert rc == 0, ff
    rc, more = run(command(4, tmp_path / "l3"), env=py_env(), timeout=180)
    assert rc == 0, more
    assert "already complete" not in more, more
    assert {l.epoch for l in ledger.read(str(tmp_path / "l3"))} == {3}, more
    assert f"final weights {ff.split('final weights ')[1].split()[0]}" in more, more
