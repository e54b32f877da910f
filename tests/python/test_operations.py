"""Operating a job (issue 12): `elastic-run status`, the Prometheus endpoint, progress lines,
the timeline picture, all against real jobs of the C++ example."""
import sys
import json
import os
import re
import signal
import subprocess
import time

import pytest

from helpers import Job, events, run, scrape, status, wait_event, worker_pid


def test_status_metrics_and_progress_of_a_running_job_that_recovers(elastic_run, example,
                                                                     tmp_path):
    log, job_file = str(tmp_path / "events.jsonl"), str(tmp_path / "job.json")
    job = Job([elastic_run, "-np", "3", "--min-np", "2", "--host-failure-limit", "0",
               "--metrics-port", "0", "--progress-interval", "1", "--job-file", job_file,
               "--event-log", log, example, "--epochs", "40", "--step-ms", "20"])
    try:
        job.wait_for(r"epoch 1 done")
        assert oct(os.stat(job_file).st_mode & 0o777) == "0o600"
        url = re.search(r"metrics on (http://\S+)", job.text()).group(1)
        # status: the table and the document agree with the job.
        p = status(elastic_run, job_file)
        assert p.returncode == 0, p.stdout
        assert "job: training, round 0, 3 worker(s)" in p.stdout, p.stdout
        for slot in ("localhost:0", "localhost:1", "localhost:2"):
            assert slot in p.stdout
        p = status(elastic_run, job_file, "--json")
        doc = json.loads(p.stdout)
        assert doc["phase"] == "training" and doc["round"] == 0 and doc["size"] == 3
        assert [m["rank"] for m in doc["members"]] == [0, 1, 2]
        assert all(m["step"] > 0 and m["epoch"] is not None for m in doc["members"]), doc
        pids = {m["slot"]: m["pid"] for m in doc["members"]}
        assert pids["localhost:2"] == worker_pid(log, "localhost:2")
        before = scrape(url)
        assert before["elastic_world_size"] == 3
        assert before["elastic_committed_step"] > 0
        assert before["elastic_rounds_total"] == 1
        # A kill: the job recovers, and status and metrics say so.
        os.kill(pids["localhost:2"], signal.SIGKILL)
        wait_event(log, lambda e: e["event"] == "round_formed" and e["round"] >= 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            doc = json.loads(status(elastic_run, job_file, "--json").stdout)
            if doc["recoveries"] and doc["recoveries"][-1]["done"]:
                break
            time.sleep(0.2)
        assert doc["size"] == 3 and doc["round"] >= 1, doc  # the slot came back
        rec = doc["recoveries"][-1]
        assert rec["slot"] == "localhost:2" and rec["done"], doc
        assert {"fence", "rendezvous", "first_step"} <= set(rec["phases"]), rec
        after = scrape(url)
        assert after['elastic_failures_total{kind="exit"}'] == 1
        assert after["elastic_rounds_total"] >= 2 and after["elastic_resets_total"] >= 1
        assert after['elastic_recovery_phase_seconds_count{phase="first_step"}'] == 1
        assert after['elastic_recovery_phase_seconds_bucket{phase="first_step",le="+Inf"}'] == 1
        assert after["elastic_workers_started_total"] == 4
        assert after["elastic_committed_step"] >= before["elastic_committed_step"]
        time.sleep(1.5)  # a progress line after the recovery
        os.kill(job.proc.pid, signal.SIGTERM)
        assert job.wait(timeout=60) == 128 + signal.SIGTERM, job.text()
    finally:
        job.kill()
    lines = re.findall(r"progress: (\d+) worker\(s\) in round (\d+) \((\w+)\), step (\d+), "
                       r"epoch (\d+) \((\d+)%\)", job.text())
    assert len(lines) >= 2, job.text()
    assert all(int(n) in (2, 3) for n, *_ in lines)
    assert "samples/s" in job.text()
    assert not os.path.exists(job_file)  # removed when the driver ends


def test_status_and_metrics_list_the_warm_spares(elastic_run, example, tmp_path):
    log, job_file = str(tmp_path / "events.jsonl"), str(tmp_path / "job.json")
    job = Job([elastic_run, "-np", "2", "--min-np", "1", "--spares", "1", "--metrics-port", "0",
               "--job-file", job_file, "--event-log", log, example, "--epochs", "40",
               "--step-ms", "20"])
    try:
        job.wait_for(r"slot localhost:2: initialised, waiting for a place")
        # The spare can be waiting before round 0 has formed: the members are those of the
        # formed round, so wait for it (the status follows the driver's event log).
        job.wait_for(r"round 0 formed")
        url = re.search(r"metrics on (http://\S+)", job.text()).group(1)
        deadline = time.monotonic() + 10
        while True:
            doc = json.loads(status(elastic_run, job_file, "--json").stdout)
            if doc["members"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert doc["spares"] == [{"slot": "localhost:2", "pid": worker_pid(log, "localhost:2")}]
        assert [m["slot"] for m in doc["members"]] == ["localhost:0", "localhost:1"], doc
        p = status(elastic_run, job_file)
        assert "warm spares (waiting for a place):" in p.stdout and "localhost:2" in p.stdout, \
            p.stdout
        assert scrape(url)["elastic_warm_spares"] == 1
        os.kill(job.proc.pid, signal.SIGTERM)
        assert job.wait(timeout=60) == 128 + signal.SIGTERM, job.text()
    finally:
        job.kill()


def test_status_without_a_job_says_so(elastic_run, tmp_path):
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    p = subprocess.run([elastic_run, "status"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=env, timeout=30)
    assert p.returncode == 1 and "no running job found" in p.stdout, p.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    p = status(elastic_run, str(bad))
    assert p.returncode == 2 and "is not a job file" in p.stdout, p.stdout
    rc, out = run([elastic_run, "status", "--help"], timeout=30)
    assert rc == 0 and "--job-file" in out and "--json" in out


def test_status_finds_the_only_running_job(elastic_run, example, tmp_path):
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    job = Job([elastic_run, "-np", "2", example, "--epochs", "40", "--step-ms", "20"], env=env)
    try:
        job.wait_for(r"epoch 0 done")
        p = subprocess.run([elastic_run, "status"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, timeout=30)
        assert p.returncode == 0 and "2 worker(s)" in p.stdout, p.stdout
        files = os.listdir(tmp_path / "elastic-run")
        # The job file, and the spool of its workers' output (driver/driver.cc).
        assert sorted(files) == [f"{job.proc.pid}.json", f"{job.proc.pid}.output"], files
    finally:
        job.kill()


TIMELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                        "elastic-timeline")


def test_status_does_not_count_a_killed_driver_not_yet_reaped(elastic_run, example, tmp_path):
    """A driver SIGKILLed whose parent has not waited for it yet is a zombie: kill(pid, 0)
    still succeeds, but it runs no job. `status` must not offer it (it would list two jobs,
    or ask a dead address)."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    dead = Job([elastic_run, "-np", "1", "--driver-timeout", "0", example, "--epochs", "40",
                "--step-ms", "20"], env=env)
    live = Job([elastic_run, "-np", "2", example, "--epochs", "40", "--step-ms", "20"], env=env)
    try:
        dead.wait_for(r"epoch 0 done")
        live.wait_for(r"epoch 0 done")
        os.kill(dead.proc.pid, signal.SIGKILL)  # not waited for: a zombie
        deadline = time.monotonic() + 10
        while open(f"/proc/{dead.proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert os.path.exists(tmp_path / "elastic-run" / f"{dead.proc.pid}.json")
        p = subprocess.run([elastic_run, "status"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, timeout=30)
        assert p.returncode == 0 and "2 worker(s)" in p.stdout, p.stdout
    finally:
        dead.kill()
        live.kill()


def test_the_timeline_picture_marks_every_fault_of_a_real_log(elastic_run, example, tmp_path):
    pytest.importorskip("matplotlib", reason="python3-matplotlib (scripts/setup-deps.sh)")
    log = str(tmp_path / "events.jsonl")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:3\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    job = Job([elastic_run, "--min-np", "2", "--max-np", "4", "--host-discovery-script",
               str(script), "--host-failure-limit", "0", "--progress-interval", "1",
               "--event-log", log, example, "--epochs", "16", "--step-ms", "20"])
    try:
        job.wait_for(r"epoch 1 done")
        os.kill(worker_pid(log, "localhost:2"), signal.SIGKILL)
        job.wait_for(r"epoch 4 done")
        hosts.write_text("localhost:4\n")  # a slot added
        job.wait_for(r"epoch 8 done")
        os.kill(worker_pid(log, "localhost:0"), signal.SIGKILL)
        assert job.wait(timeout=180) == 0, job.text()
    finally:
        job.kill()
    evs = events(log)
    want = [e for e in evs if e["event"] in ("worker_hung", "worker_leaving", "host_added",
                                             "host_removed", "host_changed", "host_blacklisted")
            or (e["event"] == "worker_lost" and e.get("phase", "detect") == "detect")]
    png = tmp_path / "timeline.png"
    p = subprocess.run([sys.executable, TIMELINE, log, "-o", str(png), "--size", "900x600"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert p.returncode == 0, p.stdout
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(head[16:20], "big") == 900 and int.from_bytes(head[20:24], "big") == 600
    m = re.search(r"(\d+) rounds, (\d+) recoveries, (\d+) faults marked", p.stdout)
    assert m, p.stdout
    rounds = len([e for e in evs if e["event"] == "round_formed"])
    assert (int(m.group(1)), int(m.group(3))) == (rounds, len(want)), (p.stdout, want)
    assert len(want) >= 3 and int(m.group(2)) == 2, p.stdout  # two kills, one addition
    bad = subprocess.run([sys.executable, TIMELINE, log, "-o", str(png), "--size", "9"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert bad.returncode != 0 and "WIDTHxHEIGHT" in bad.stdout


DISCOVERY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                         "discovery")
PODS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "kubectl_pods.json")


def kubectl_stand_in(tmp_path):
    # No cluster runs here: a `kubectl` on PATH that checks its arguments and prints a pod list
    # in the shape of `kubectl get pods -o json` (a v1 List of Pods; written for this test from
    # the API's schema, not recorded from a cluster), and logs how it was called.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path}/kubectl.calls
[ "$1 $2" = "get pods" ] || {{ echo "unexpected: $*" >&2; exit 1; }}
cat {PODS}
""")
    kubectl.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")


def test_the_kubernetes_script_keeps_ready_running_pods(tmp_path):
    env = kubectl_stand_in(tmp_path)
    p = subprocess.run([os.path.join(DISCOVERY, "kubernetes.py"), "-l", "app=trainer", "-n",
                        "ml"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["trainer-0:2", "trainer-1:1"]
    assert (tmp_path / "kubectl.calls").read_text().split() == [
        "get", "pods", "-l", "app=trainer", "-o", "json", "-n", "ml"]


def test_elastic_run_follows_the_pods_the_kubernetes_script_lists(elastic_run, test_worker,
                                                                  tmp_path):
    # The pods are names only here: the launcher template runs their workers on this machine.
    env = kubectl_stand_in(tmp_path)
    rc, out = run([elastic_run, "--min-np", "3", "--host-discovery-script",
                   f"{DISCOVERY}/kubernetes.py -l app=trainer", "--driver-address", "127.0.0.1",
                   "--launcher-template", "sh -c {command}", test_worker, "collectives"],
                  env=env, timeout=120)
    assert rc == 0, out
    assert "round 0: 3 worker(s) [trainer-0:0 trainer-0:1 trainer-1:0]" in out, out


def test_the_hosts_file_script(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the trainers\nnode1:4\nnode2\n")
    p = subprocess.run([os.path.join(DISCOVERY, "hostsfile.sh"), str(hosts)],
                       stdout=subprocess.PIPE, text=True, timeout=30)
    assert p.returncode == 0 and "node1:4" in p.stdout
    p = subprocess.run([os.path.join(DISCOVERY, "hostsfile.sh"), str(tmp_path / "none")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    assert p.returncode == 1 and "cannot read" in p.stdout
