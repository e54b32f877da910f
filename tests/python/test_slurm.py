"""elastic-run on a real Slurm (Debian's slurm-wlm and munge): a two-node cluster on this one
machine (slurmd -N n1, -N n2; NodeAddr 127.0.0.1, a port each), configured, started and stopped
by the test under a temporary folder with its own munge socket. A job allocated with salloc
runs elastic-run with scripts/discovery/slurm.sh and srun as the launcher; node n2 is drained
(the job leaves it) and resumed (the job takes it back), and the model is the fault-free one."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from helpers import Job, run

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SLURM = os.path.join(ROOT, "scripts", "discovery", "slurm.sh")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("slurmctld") is None or shutil.which("munged") is None,
    reason="needs root, slurm-wlm and munge (scripts/setup-deps.sh installs them)")


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def slurm(tmp_path):
    """A two-node Slurm cluster; yields the environment that points the Slurm commands at it."""
    d = tmp_path
    for sub in ("state", "spool-n1", "spool-n2"):
        (d / sub).mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = d / "munge.sock"
    subprocess.run(["munged", f"--socket={sock}", f"--key-file={key}",
                    f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid",
                    f"--seed-file={d}/munged.seed", "-f"], check=True)
    ctl, p1, p2 = free_ports(3)
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=elastictest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctl}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName=n1 NodeAddr=127.0.0.1 Port={p1} CPUs=4 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port={p2} CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    try:
        subprocess.run(["slurmctld", "-c", "-f", str(conf)], check=True, env=env)
        for node in ("n1", "n2"):
            subprocess.run(["slurmd", "-N", node, "-f", str(conf)], check=True, env=env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env,
                                 stdout=subprocess.PIPE, text=True).stdout
            if sorted(out.split()) == sorted(["n1", "idle", "n2", "idle"]):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the Slurm nodes did not come up: {out!r}; "
                        f"{(d / 'slurmctld.log').read_text()[-2000:]}")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, stderr=subprocess.DEVNULL)
        for pidfile in ("slurmd-n1.pid", "slurmd-n2.pid", "slurmctld.pid", "munged.pid"):
            try:
                os.kill(int((d / pidfile).read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        time.sleep(0.5)


def state_of(env, node):
    out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], env=env,
                         stdout=subprocess.PIPE, text=True).stdout.strip()
    return out


def test_a_slurm_job_leaves_a_drained_node_and_takes_it_back(elastic_run, build_dir, slurm,
                                                            tmp_path):
    example = str(build_dir / "examples" / "logistic_regression")
    rc, baseline = run([elastic_run, "-np", "2", example, "--epochs", "20"])
    assert rc == 0, baseline
    final = re.search(r"final: .*$", baseline, re.M).group(0)
    log = tmp_path / "events.jsonl"
    job = Job(["salloc", "-N2", "--ntasks-per-node=2",
               elastic_run, "--min-np", "2", "--host-discovery-script", SLURM,
               "--launcher-template", "srun --overlap -N1 -n1 -w {host} sh -c {command}",
               "--driver-address", "127.0.0.1", "--event-log", str(log),
               example, "--epochs", "20", "--step-ms", "20"], env=slurm)
    try:
        job.wait_for(r"round 0 formed with 4 worker\(s\)", timeout=60)
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=test"],
                       env=slurm, check=True)
        job.wait_for(r"round \d+: 2 worker\(s\) \[n1:0 n1:1\] \(hosts changed\)", timeout=60)
        assert state_of(slurm, "n2").startswith("drng"), state_of(slurm, "n2")
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], env=slurm,
                       check=True)
        job.wait_for(r"round \d+ formed with 4 worker\(s\)", count=2, timeout=60)
        assert job.wait(timeout=180) == 0, job.text()
    finally:
        job.kill()
    assert final in job.text(), job.text()
    ev = [json.loads(l) for l in log.read_text().splitlines()]
    assert [e["host"] for e in ev if e["event"] == "host_removed"] == ["n2"]
    assert [e["host"] for e in ev if e["event"] == "host_added"] == ["n2"]
    sizes = [len(e["members"]) for e in ev if e["event"] == "round_formed"]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4, sizes


def test_the_slurm_script_outside_an_allocation_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.run([SLURM], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=30)
    assert p.returncode == 2 and "inside an allocation" in p.stdout, p.stdout
