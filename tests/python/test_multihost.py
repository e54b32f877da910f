"""Several hosts on one machine: network namespaces with their own addresses, joined by a
bridge; workers start in them through --launcher-template 'ip netns exec {host} ...'. Needs
root and iproute2; skipped cleanly elsewhere. Only addresses this test creates are used."""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from helpers import Job, job_token_of, run, token_on_a_command_line
from netns_hosts import SUBNET, namespace_hosts, namespace_processes, sh, sshd_on

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")

@pytest.fixture
def hosts():
    """Two namespaces, h1 and h2, on a bridge; the driver is the bridge's address."""
    with namespace_hosts(2) as names:
        yield names


def launcher_args(names, slots=2):
    return ["-H", ",".join(f"{n}:{slots}" for n in names), "--driver-address", f"{SUBNET}.1",
            "--launcher-template", "ip netns exec {host} sh -c {command}"]


def test_collectives_across_namespace_hosts(elastic_run, test_worker, hosts):
    rc, out = run([elastic_run, "-np", "4"] + launcher_args(hosts) + [test_worker, "collectives"])
    assert rc == 0, out
    for r in range(4):
        assert f"[{r}]<stdout>:collectives ok rank {r} of 4" in out


def test_a_host_that_dies_leaves_the_other_training(elastic_run, build_dir, hosts, tmp_path):
    example = str(build_dir / "examples" / "logistic_regression")
    baseline_rc, baseline = run([elastic_run, "-np", "2", example, "--epochs", "6"])
    assert baseline_rc == 0, baseline
    final = re.search(r"final: .*$", baseline, re.M).group(0)
    job = Job([elastic_run, "-np", "4", "--min-np", "2"] + launcher_args(hosts) +
              [example, "--epochs", "6", "--step-ms", "10"])
    try:
        job.wait_for(r"epoch 0 done")
        # The whole second host goes: every process in its namespace is killed.
        pids = subprocess.run(["ip", "netns", "pids", hosts[1]], stdout=subprocess.PIPE,
                              text=True).stdout.split()
        assert pids
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        assert job.wait() == 0, job.text()
        assert final in job.text()
        survivors = re.escape(f"2 worker(s) [{hosts[0]}:0 {hosts[0]}:1]")
        assert re.search(r"round \d+: " + survivors, job.text())
    finally:
        job.kill()


@pytest.fixture
def sshd_hosts(hosts, tmp_path):
    """An sshd in each namespace host (port 2222, its own keys and config under tmp_path)."""
    with sshd_on(hosts, tmp_path) as got:
        yield got


def test_ssh_launcher_runs_workers_on_namespace_hosts(elastic_run, test_worker, sshd_hosts):
    addrs, key = sshd_hosts
    rc, out = run([elastic_run, "-np", "4", "-H", ",".join(f"{a}:2" for a in addrs),
                   "--driver-address", f"{SUBNET}.1", "--ssh-port", "2222",
                   "--ssh-identity-file", key, test_worker, "collectives"])
    assert rc == 0, out
    for r in range(4):
        assert f"[{r}]<stdout>:collectives ok rank {r} of 4" in out


def test_a_host_whose_link_goes_down_is_lost_and_leaves_nothing_running(
        elastic_run, build_dir, hosts, tmp_path):
    example = str(build_dir / "examples" / "logistic_regression")
    baseline_rc, baseline = run([elastic_run, "-np", "2", example, "--epochs", "6"])
    assert baseline_rc == 0, baseline
    final = re.search(r"final: .*$", baseline, re.M).group(0)
    log = str(tmp_path / "events.jsonl")
    job = Job([elastic_run, "-np", "4", "--min-np", "2", "--liveness-timeout", "3",
               "--event-log", log] + launcher_args(hosts) +
              [example, "--epochs", "6", "--step-ms", "10"])
    veth = f"elv{hosts[1][2:8]}1"  # the second host's end on the bridge (see `hosts`)
    try:
        job.wait_for(r"epoch 0 done")
        # No reset, no FIN: the second host's link silently goes away.
        sh("ip", "link", "set", veth, "down")
        job.wait_for(r"round \d+: 2 worker\(s\) \[" + re.escape(f"{hosts[0]}:0 {hosts[0]}:1"),
                     timeout=60)
        sh("ip", "link", "set", veth, "up")  # the link comes back
        assert job.wait() == 0, job.text()
        assert final in job.text()
    finally:
        job.kill()
    with open(log) as f:
        hung = [json.loads(l) for l in f if '"worker_hung"' in l]
    assert sorted(e["slot"] for e in hung) == [f"{hosts[1]}:0", f"{hosts[1]}:1"], hung
    assert all("Watch stream broke" in e["reason"] or "silent" in e["reason"] for e in hung)
    left = subprocess.run(["ip", "netns", "pids", hosts[1]], stdout=subprocess.PIPE,
                          text=True).stdout.split()
    assert left == [], left  # nothing of that host keeps running


@pytest.mark.parametrize("failure", ["refused key", "no sshd"])
def test_an_ssh_launch_that_fails_is_named_as_such(elastic_run, test_worker, sshd_hosts,
                                                   tmp_path, failure):
    addrs, key = sshd_hosts
    port = "2222"
    if failure == "refused key":
        key = str(tmp_path / "stranger_key")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
    else:
        port = "2223"  # nothing listens there: connection refused
    rc, out = run([elastic_run, "-np", "2", "-H", ",".join(f"{a}:1" for a in addrs),
                   "--driver-address", f"{SUBNET}.1", "--ssh-port", port,
                   "--ssh-identity-file", key, test_worker, "collectives"], timeout=120)
    assert rc == 255, out
    assert "exit status 255" in out and "ssh could not run the worker" in out, out


def test_an_ssh_host_that_fails_leaves_an_elastic_job_on_the_others(
        elastic_run, test_worker, sshd_hosts, tmp_path):
    # Elastic: the host whose ssh fails is blacklisted and the job runs on the other.
    addrs, key = sshd_hosts
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{addrs[0]}:1\n{SUBNET}.99:1\n")  # .99: on the bridge, no one there
    rc, out = run([elastic_run, "-np", "1", "--min-np", "1", "--hostfile", str(hosts),
                   "--driver-address", f"{SUBNET}.1", "--ssh-port", "2222",
                   "--ssh-identity-file", key, test_worker, "collectives"], timeout=120)
    assert rc == 0, out
    assert "ssh could not run the worker" in out, out
    assert "[0]<stdout>:collectives ok rank 0 of 1" in out, out


def test_the_token_is_on_no_command_line_with_ssh_a_spare_and_a_relaunch(
        elastic_run, test_worker, sshd_hosts):
    # The ssh launcher passes the token on stdin to the remote script; so does every later
    # launch: a warm spare, and a slot started again after its worker was killed. So too the
    # workers' TLS credentials (the driver listens beyond loopback: --tls auto is on).
    addrs, key = sshd_hosts
    job = Job([elastic_run, "-np", "2", "--min-np", "2", "--spares", "1", "-H",
               ",".join(f"{a}:2" for a in addrs), "--driver-address", f"{SUBNET}.1",
               "--ssh-port", "2222", "--ssh-identity-file", key, test_worker, "sleep"])
    try:
        pids = [int(m.group(1)) for m in job.wait_for(r"sleeping pid (\d+)", count=3)]
        token = job_token_of(pids[0])
        tls = job_token_of(pids[0], b"ELASTIC_JOB_TLS")
        assert token_on_a_command_line(token) == []
        assert token_on_a_command_line(tls) == []
        os.kill(pids[1], signal.SIGKILL)  # its slot is started again
        job.wait_for(r"sleeping pid (\d+)", count=4)
        assert token_on_a_command_line(token) == []
        assert token_on_a_command_line(tls) == []
    finally:
        job.kill()


def test_ssh_workers_on_two_hosts_ride_out_a_killed_driver_and_are_adopted(
        elastic_run, build_dir, hosts, sshd_hosts, tmp_path):
    """The driver is SIGKILLed (its ssh connections go with it); the workers on both hosts
    train on, writing to their files there, and the same command started again attaches to
    them over ssh: the same processes finish the job with the fault-free model, every epoch's
    line shown, and nothing is left on the hosts."""
    addrs, key = sshd_hosts
    example = str(build_dir / "examples" / "logistic_regression")
    baseline_rc, baseline = run([elastic_run, "-np", "2", example, "--epochs", "6"])
    assert baseline_rc == 0, baseline
    final = re.search(r"final: .*$", baseline, re.M).group(0)
    args = [elastic_run, "-np", "4", "--state-dir", str(tmp_path / "state"),
            "--driver-timeout", "60", "--event-log", str(tmp_path / "events.jsonl"),
            "-H", ",".join(f"{a}:2" for a in addrs), "--driver-address", f"{SUBNET}.1",
            "--ssh-port", "2222", "--ssh-identity-file", key,
            example, "--epochs", "6", "--step-ms", "10"]
    first = Job(args)
    second = None
    try:
        first.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=90)
        pids = namespace_processes(hosts, "logistic_regression")
        assert len(pids) == 4, pids
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        time.sleep(2)  # training goes on with no driver
        assert namespace_processes(hosts, "logistic_regression") == pids
        second = Job(args)
        second.wait_for(r"resuming the job in .*adopted 4 running worker", timeout=30)
        second.wait_for(r"4 worker\(s\) re-attached", timeout=60)
        assert namespace_processes(hosts, "logistic_regression") == pids
        assert second.wait(timeout=120) == 0, second.text()
    finally:
        for job in (first, second):
            if job:
                job.kill()
    assert final in second.text(), second.text()
    shown = {int(m.group(1)) for l in first.lines + second.lines
             for m in [re.match(r"\[0\]<stdout>:epoch (\d+) done", l)] if m}
    assert shown == set(range(6)), (sorted(shown), first.text(), second.text())
    evs = [json.loads(l) for l in open(tmp_path / "events.jsonl") if l.strip()]
    resumed = [e for e in evs if e["event"] == "driver_resumed"]
    assert len(resumed) == 1 and resumed[0]["lost"] == [], resumed
    assert len(resumed[0]["reattached"]) == 4, resumed
    deadline = time.monotonic() + 15
    while namespace_processes(hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert namespace_processes(hosts) == []
