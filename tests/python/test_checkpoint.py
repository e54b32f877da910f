"""Durable checkpoints (--checkpoint-dir, docs/checkpoints.md): a job killed whole and started
again resumes exactly once, a job whose every holder of the state dies goes on from the newest
checkpoint, corrupt checkpoints are skipped, a full disk or a second job on the folder does not
stop training. The oracle is the example's ledger (every sample of every epoch once, in the
lineage that survived) and its final hash against a fault-free run's."""
import json
import pathlib
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

import ledger
from helpers import (Job, check_event_schema, events, procs_with_marker, run, wait_event,
                     worker_pid)

EPOCHS = 8
ARGS = ["--epochs", str(EPOCHS), "--step-ms", "4", "--commit-every", "4"]


@pytest.fixture(scope="module")
def want(elastic_run, example):
    rc, out = run([elastic_run, "-np", "2", example] + ARGS)
    assert rc == 0, out
    return ledger.final_hash(out)


def marked_env(marker):
    env = dict(os.environ)
    env["ELASTIC_TEST_MARK"] = marker
    return env


def wait_gone(marker, timeout=15):
    deadline = time.monotonic() + timeout
    while procs_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not procs_with_marker(marker), "processes of the killed job are left"


def ckpt_args(folder, interval="0.3", keep=None):
    args = ["--checkpoint-dir", str(folder), "--checkpoint-interval", interval]
    return args + (["--checkpoint-keep", str(keep)] if keep else [])


def test_a_job_killed_whole_and_started_again_trains_every_sample_once(
        elastic_run, example, want, tmp_path):
    """The driver and its workers are killed (SIGKILL of the process group) at random points,
    three times, and the same command is started again each time: the last run ends with the
    fault-free model, and the runs' ledgers together (a step trained again by a later run
    supersedes the earlier run's) consume every sample of every epoch exactly once."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    folder, marker = tmp_path / "ckpt", uuid.uuid4().hex
    runs = []
    for k in range(4):
        book, log = str(tmp_path / f"ledger-{k}"), str(tmp_path / f"events-{k}.jsonl")
        runs.append(book)
        job = Job([elastic_run, "-np", "2", "--event-log", log] + ckpt_args(folder) + [example]
                  + ARGS + ["--ledger", book], env=marked_env(marker))
        try:
            if k == 3:
                assert job.wait(timeout=180) == 0, job.text()
                break
            # Killed once a checkpoint of this run exists, at a random point after it.
            wait_event(log, lambda e: e["event"] == "checkpoint_written", timeout=60)
            time.sleep(rng.uniform(0.0, 1.0))
            assert job.proc.poll() is None, f"run {k} ended before it was killed (seed {seed})"
        finally:
            job.kill()
        job.wait(timeout=30)
        wait_gone(marker)
        check_event_schema(log)
    out = job.text()
    assert ledger.final_hash(out) == want, f"seed {seed}\n{out}"
    assert "resuming from checkpoint version" in out, out
    # Within a run a rollback is at most a commit interval; across runs, what the kill cost
    # since the last checkpoint.
    problems = ledger.check(runs, 4096, EPOCHS, max_rollback=10_000)
    assert not problems, f"seed {seed}: " + "\n".join(problems)
    # Each later run resumed (training from scratch would pass the checks above too).
    for k in range(1, len(runs)):
        first = min(l.step for l in ledger.read(runs[k]))
        assert first > 1, f"seed {seed}: run {k} started again at step 1"
    assert not procs_with_marker(marker)


def test_every_holder_lost_mid_job_goes_on_from_the_newest_checkpoint(
        elastic_run, example, want, tmp_path):
    """Both workers (every holder of the state) are killed at once: the next round has no
    commit, so its rank 0 restores the newest checkpoint; the job ends 0 with the fault-free
    model, and the state_restored event says how many committed steps were lost."""
    folder, log, book = tmp_path / "ckpt", str(tmp_path / "events.jsonl"), str(tmp_path / "l")
    job = Job([elastic_run, "-np", "2", "--min-np", "2", "--host-failure-limit", "0",
               "--event-log", log] + ckpt_args(folder) + [example] + ARGS + ["--ledger", book])
    try:
        written = wait_event(log, lambda e: e["event"] == "checkpoint_written", timeout=60)
        time.sleep(0.2)
        for slot in ("localhost:0", "localhost:1"):
            os.kill(worker_pid(log, slot), 9)
        assert job.wait(timeout=180) == 0, job.text()
    finally:
        job.kill()
    out = job.text()
    assert ledger.final_hash(out) == want, out
    restored = [e for e in events(log) if e["event"] == "state_restored"]
    assert len(restored) == 1, events(log)
    r = restored[0]
    assert r["state_lost"] is True and r["version"] >= written["version"], r
    lost = [e for e in events(log) if e["event"] == "state_lost"]
    assert lost and lost[0]["from_checkpoint"] is True, lost
    assert r["steps_lost"] == lost[0]["newest_committed"] - r["version"] >= 0, (r, lost)
    assert re.search(r"state restored from checkpoint version \d+ .*committed step\(s\) since "
                     r"it are lost", out), out
    problems = ledger.check(book, 4096, EPOCHS, max_rollback=10_000)
    assert not problems, "\n".join(problems)
    check_event_schema(log)


def test_without_a_checkpoint_every_holder_lost_still_ends_the_job(
        elastic_run, example, tmp_path):
    """--checkpoint-dir given but nothing written yet (a long interval): state lost is what it
    was, exit 1, and the message names the empty folder."""
    folder, log = tmp_path / "ckpt", str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "-np", "2", "--min-np", "2", "--host-failure-limit", "0",
               "--event-log", log] + ckpt_args(folder, interval="3600") + [example] + ARGS)
    try:
        # The first checkpoint is due at the first commit; wait for it, then for more commits.
        wait_event(log, lambda e: e["event"] == "checkpoint_written", timeout=60)
        for name in os.listdir(folder):
            if name.startswith("v"):
                subprocess.run(["rm", "-rf", str(folder / name)], check=True)
        for slot in ("localhost:0", "localhost:1"):
            os.kill(worker_pid(log, slot), 9)
        assert job.wait(timeout=120) == 1, job.text()
    finally:
        job.kill()
    assert "holds no valid checkpoint" in job.text(), job.text()
    assert "state lost" in job.text()


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_one_before_used(
        elastic_run, example, want, tmp_path):
    """The job is killed; its newest checkpoint's model file gets a flipped bit. The restart
    names the corrupt file, resumes from the version before, and ends with the fault-free
    model."""
    folder, log = tmp_path / "ckpt", str(tmp_path / "events.jsonl")
    marker = uuid.uuid4().hex
    job = Job([elastic_run, "-np", "2", "--event-log", log] + ckpt_args(folder, keep=3)
              + [example] + ARGS, env=marked_env(marker))
    try:
        wait_event(log, lambda e: e["event"] == "checkpoint_written", timeout=60)
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(folder) if n.startswith("v")]) < 2:
            assert time.monotonic() < deadline and job.proc.poll() is None, job.text()
            time.sleep(0.05)
    finally:
        job.kill()
    job.wait(timeout=30)
    wait_gone(marker)
    versions = sorted(n for n in os.listdir(folder) if n.startswith("v"))
    newest = folder / versions[-1] / "tracked.model"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x40
    newest.write_bytes(bytes(data))
    log2 = str(tmp_path / "events-2.jsonl")
    rc, out = run([elastic_run, "-np", "2", "--event-log", log2] + ckpt_args(folder, keep=3)
                  + [example] + ARGS, timeout=180)
    assert rc == 0, out
    assert f"checkpoint skipped: {newest}: checksum mismatch" in out, out
    restored = [e for e in events(log2) if e["event"] == "state_restored"]
    assert restored and restored[0]["version"] < int(versions[-1][1:]), (restored, versions)
    assert ledger.final_hash(out) == want, out


def test_a_full_disk_is_said_once_and_training_goes_on(elastic_run, example, tmp_path):
    """The checkpoint folder is a 64 KiB tmpfs and the state (a 40,000-feature model) does not
    fit: every write fails, the driver says so once, `elastic-run status` and the event log
    count the failures, and the job ends 0."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        log = str(tmp_path / "events.jsonl")
        args = ["--epochs", "2", "--step-ms", "4", "--features", "40000", "--samples", "1024"]
        rc, out = run([elastic_run, "-np", "2", "--event-log", log] + ckpt_args(mnt, "0.2")
                      + [example] + args, timeout=240)
        assert rc == 0, out
        failed = [e for e in events(log) if e["event"] == "checkpoint_failed"]
        assert len(failed) >= 2, events(log)[-5:]
        assert all("No space left on device" in e["message"] for e in failed), failed
        said = [l for l in out.splitlines() if "[driver]" in l and "checkpoint of version" in l]
        assert len(said) == 1, said
        # Nothing half written is left to be taken for a checkpoint.
        assert not [n for n in os.listdir(mnt) if n.startswith("v")], os.listdir(mnt)
        check_event_schema(log)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_a_folder_deleted_or_replaced_under_the_job_is_said_once_and_comes_back(
        elastic_run, example, tmp_path):
    """While the job trains, its checkpoint folder is deleted (the next write makes it again),
    then a file takes its place (writes fail, said once) and goes: checkpoints come back,
    training never stops, and the model is the fault-free one."""
    args = ["--epochs", "12", "--step-ms", "4", "--commit-every", "4"]
    rc, ref = run([elastic_run, "-np", "2", example] + args, timeout=120)
    assert rc == 0, ref
    folder, log = tmp_path / "ck", str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "-np", "2", "--event-log", log] + ckpt_args(folder, "0.2")
              + [example] + args)
    try:
        first = wait_event(log, lambda e: e["event"] == "checkpoint_written", timeout=60)
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        t = time.time()
        again = wait_event(log, lambda e: e["event"] == "checkpoint_written" and e["ts"] > t,
                           timeout=60)
        assert again["version"] > first["version"] and os.path.isdir(again["path"]), again
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        folder.write_text("not a folder\n")
        failed = wait_event(log, lambda e: e["event"] == "checkpoint_failed", timeout=60)
        wait_event(log, lambda e: e["event"] == "checkpoint_failed" and e["ts"] > failed["ts"],
                   timeout=60)
        folder.unlink()
        wait_event(log, lambda e: e["event"] == "checkpoint_written" and e["ts"] > failed["ts"],
                   timeout=60)
        assert job.wait(timeout=180) == 0, job.text()
    finally:
        job.kill()
    out = job.text()
    said = [l for l in out.splitlines() if "[driver]" in l and "checkpoint of version" in l]
    assert len(said) == 1, said
    assert "checkpoints are written again" in out, out
    assert ledger.final_hash(out) == ledger.final_hash(ref), out


def test_a_second_job_on_one_folder_is_refused(elastic_run, example, tmp_path):
    folder = tmp_path / "ckpt"
    job = Job([elastic_run, "-np", "1"] + ckpt_args(folder) + [example, "--epochs", "1000",
                                                               "--step-ms", "5"])
    try:
        job.wait_for(r"round 0 formed", timeout=60)
        rc, out = run([elastic_run, "-np", "1"] + ckpt_args(folder) + [example], timeout=30)
        assert rc == 2, out
        assert f"the checkpoint folder {folder} is in use by another job (elastic-run pid " \
               f"{job.proc.pid})" in out, out
    finally:
        job.kill()
        job.wait(timeout=30)


@pytest.mark.parametrize("args,message", [
    (["--checkpoint-interval", "5"], "--checkpoint-interval and --checkpoint-keep need "
                                     "--checkpoint-dir"),
    (["--checkpoint-keep", "3"], "need --checkpoint-dir"),
    (["--checkpoint-dir", "/tmp/x", "--checkpoint-keep", "0"], "--checkpoint-keep"),
    (["--checkpoint-dir", "/tmp/x", "--checkpoint-interval", "0"], "--checkpoint-interval"),
    (["--checkpoint-dir", "/proc/version/x"], "--checkpoint-dir"),
])
def test_bad_checkpoint_options_exit_2(elastic_run, args, message):
    rc, out = run([elastic_run, "-np", "1"] + args + ["true"], timeout=30)
    assert rc == 2, out
    assert message in out, out


DIGITS = [str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"),
          "--epochs", "6", "--commit-every", "5", "--loader-workers", "2", "--step-ms", "15"]
PY = sys.executable
HASH = re.compile(r"final: .* hash ([0-9a-f]{16})")


def test_torch_state_checkpoints_resume_and_load_outside_elastic_run(elastic_run, tmp_path):
    """examples/train_digits.py (TorchState: model, optimizer, ElasticSampler, values) with no
    checkpoint code of its own: killed whole after a checkpoint, started again, it resumes and
    ends with the fault-free model; the checkpoint's model file is a state dict torch.load
    reads without elastic-run."""
    rc, out = run([elastic_run, "-np", "2", PY] + DIGITS, timeout=300)
    assert rc == 0, out
    want = HASH.search(out).group(1)
    folder, log, marker = tmp_path / "ckpt", str(tmp_path / "events.jsonl"), uuid.uuid4().hex
    job = Job([elastic_run, "-np", "2", "--event-log", log] + ckpt_args(folder, "0.5")
              + [PY] + DIGITS, env=marked_env(marker))
    try:
        wait_event(log, lambda e: e["event"] == "checkpoint_written", timeout=120)
        assert job.proc.poll() is None, job.text()
    finally:
        job.kill()
    job.wait(timeout=30)
    wait_gone(marker)
    rc, out = run([elastic_run, "-np", "2"] + ckpt_args(folder, "0.5") + [PY] + DIGITS,
                  timeout=300)
    assert rc == 0, out
    assert "resuming from checkpoint version" in out, out
    assert HASH.search(out).group(1) == want, out
    newest = max(n for n in os.listdir(folder) if n.startswith("v"))
    manifest = json.loads((folder / newest / "manifest.json").read_text())
    assert {f["name"] for f in manifest["files"]} == {"model", "optimizer", "sampler", "values"}
    code = ("import sys, torch; sd = torch.load(sys.argv[1]); "
            "print(sorted(sd)[:2], all(torch.is_tensor(v) for v in sd.values()))")
    p = subprocess.run([PY, "-c", code, str(folder / newest / "value.model")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("True"), p.stdout + p.stderr


def test_status_and_metrics_show_the_newest_checkpoint_and_the_failures(
        elastic_run, example, tmp_path):
    from helpers import scrape, status
    folder, log, job_file = tmp_path / "ck", str(tmp_path / "events.jsonl"), str(tmp_path / "j")
    job = Job([elastic_run, "-np", "2", "--metrics-port", "0", "--job-file", job_file,
               "--event-log", log] + ckpt_args(folder, "0.2") + [example, "--epochs", "1000",
                                                                 "--step-ms", "5"])
    try:
        written = wait_event(log, lambda e: e["event"] == "checkpoint_written", timeout=60)
        url = re.search(r"metrics on (http://\S+)", job.text()).group(1)
        doc = json.loads(status(elastic_run, job_file, "--json").stdout)
        c = doc["checkpoint"]
        assert c["version"] >= written["version"] and c["path"].startswith(str(folder)), doc
        assert c["failures"] == 0 and c["error"] is None and c["seconds"] >= 0, c
        assert "checkpoint: version" in status(elastic_run, job_file).stdout
        m = scrape(url)
        assert m["elastic_checkpoint_version"] >= written["version"], m
        assert m["elastic_checkpoint_failures_total"] == 0, m
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        folder.write_text("in the way\n")
        wait_event(log, lambda e: e["event"] == "checkpoint_failed", timeout=60)
        c = json.loads(status(elastic_run, job_file, "--json").stdout)["checkpoint"]
        assert c["failures"] >= 1 and "Not a directory" in (c["error"] or ""), c
        assert "failed write(s), failing now:" in status(elastic_run, job_file).stdout
        assert scrape(url)["elastic_checkpoint_failures_total"] >= 1
        os.kill(job.proc.pid, signal.SIGTERM)
        assert job.wait(timeout=60) == 128 + signal.SIGTERM, job.text()
    finally:
        job.kill()


def test_a_state_subclass_writes_and_reads_its_own_checkpoint(elastic_run, tmp_path):
    """tests/python/workers/own_state.py: an elastic.State subclass with checkpoint_files()
    and load_checkpoint(); killed whole after a checkpoint and started again, it resumes (its
    file is what it wrote) and ends with the sum of every step once."""
    worker = [PY, str(pathlib.Path(__file__).parent / "workers" / "own_state.py"), "400"]
    folder, log, marker = tmp_path / "ck", str(tmp_path / "events.jsonl"), uuid.uuid4().hex
    job = Job([elastic_run, "-np", "2", "--event-log", log] + ckpt_args(folder, "0.2") + worker,
              env=marked_env(marker))
    try:
        written = wait_event(log, lambda e: e["event"] == "checkpoint_written" and
                             e["version"] >= 20, timeout=60)
        assert job.proc.poll() is None, job.text()
    finally:
        job.kill()
    job.wait(timeout=30)
    wait_gone(marker)
    text = (pathlib.Path(written["path"]) / "value.sum.txt").read_text().split()
    assert int(text[1]) == written["version"] and int(text[0]) == sum(range(1, int(text[1]) + 1))
    rc, out = run([elastic_run, "-np", "2"] + ckpt_args(folder, "0.2") + worker, timeout=120)
    assert rc == 0, out
    assert "resuming from checkpoint version" in out, out
    assert f"own state: total {sum(range(1, 401))} after 400 steps" in out, out
