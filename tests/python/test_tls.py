"""The control plane's TLS (--tls, docs/security.md) on the wire: a capture on the bridge of
namespace hosts (tcpdump, an oracle outside the product) shows neither the job token nor the
job's state of a job whose driver the workers dial beyond loopback, and shows both once the
job runs with --tls off (so the capture would see them). A client without the job's
credentials is refused. Needs root, iproute2 and tcpdump."""
import json
import os
import re
import shutil
import signal
import subprocess

import pytest

import ledger
from helpers import Job, run
from netns_hosts import SUBNET, namespace_hosts

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tcpdump") is None,
    reason="needs root, iproute2 and tcpdump (scripts/setup-deps.sh installs them)")

EPOCHS = 4
SAMPLES = 4096  # the example's default


class Capture:
    """tcpdump on an interface into a file, from when it says it listens until stop()."""

    def __init__(self, interface, path):
        self.path = path
        self.proc = subprocess.Popen(
            ["tcpdump", "-i", interface, "-U", "-n", "-s", "0", "-w", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        said = []
        for line in self.proc.stderr:  # its first line, when it captures
            said.append(line)
            if "listening on" in line:
                break
        assert "listening on" in "".join(said), "".join(said)

    def stop(self):
        """The captured bytes (the whole file: headers and payloads)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # tcpdump flushes its file and exits
            self.proc.wait(timeout=30)
        return self.path.read_bytes()


@pytest.mark.parametrize("tls", ["auto", "off"])
def test_a_capture_on_the_bridge_shows_no_token_and_no_state_with_tls(
        elastic_run, example, fault_free_hash, tmp_path, tls):
    with namespace_hosts(2) as names:
        bridge = "elbr" + names[0][2:8]  # netns_hosts names them alike
        capture = Capture(bridge, tmp_path / "bridge.pcap")
        job_file = tmp_path / "job.json"
        book = str(tmp_path / "ledger")
        job = Job([elastic_run, "-np", "4", "-H", ",".join(f"{n}:2" for n in names),
                   "--driver-address", f"{SUBNET}.1", "--tls", tls, "--job-file", str(job_file),
                   "--launcher-template", "ip netns exec {host} sh -c {command}",
                   example, "--epochs", str(EPOCHS), "--step-ms", "5", "--ledger", book])
        try:
            job.wait_for(r"epoch 0 done", timeout=60)
            token = json.loads(job_file.read_text())["token"].encode()
            assert job.wait(timeout=120) == 0, job.text()
        finally:
            job.kill()
            seen = capture.stop()
    on = tls == "auto"
    said = re.search(r"workers dial \S+ \(([^)]*)\)", job.text()).group(1)
    assert said == ("mutual TLS with the job's own CA" if on else "plain text"), said
    assert f"hash {fault_free_hash}" in job.text(), job.text()
    assert not ledger.check(book, SAMPLES, EPOCHS, max_rollback=0)
    # The control plane's traffic is on the bridge (the workers dial its address)...
    port = int(re.search(r"workers dial [0-9.]+:(\d+)", job.text()).group(1))
    assert len(seen) > 10000, len(seen)
    # ...and in clear only without TLS: the token of every call, and the slots and keys of
    # the rendezvous (the gRPC messages).
    clear = [token, f"{names[0]}:0".encode(), f"{names[1]}:1".encode()]
    found = [bytes(s) for s in clear if s in seen]
    assert found == ([] if on else clear), (found, port)


def test_a_client_without_the_jobs_credentials_is_refused(elastic_run, test_worker, tmp_path):
    """`elastic-run status` is a client of the driver's gRPC service like a worker: with the
    job file's credentials it is answered; without them (the token alone), or with another
    job's, it is refused."""
    files = [tmp_path / "job.json", tmp_path / "other.json"]
    jobs = [Job([elastic_run, "-np", "1", "--tls", "on", "--job-file", str(f), test_worker,
                 "sleep"]) for f in files]
    try:
        for j in jobs:
            j.wait_for(r"sleeping pid \d+", timeout=60)
        mine, other = (json.loads(f.read_text()) for f in files)
        assert mine["tls"] and other["tls"] and mine["tls"] != other["tls"]

        def status(**changes):
            doc = dict(mine, **changes)
            doc = {k: v for k, v in doc.items() if v is not None}
            path = tmp_path / "probe.json"
            path.write_text(json.dumps(doc))
            return run([elastic_run, "status", "--job-file", str(path)], timeout=60)

        rc, out = status()
        assert rc == 0 and out.startswith("job: "), out
        rc, out = status(tls=None)  # the token alone, over plain text
        assert rc == 1, out
        rc, out = status(tls=other["tls"])  # another job's CA and certificate
        assert rc == 1, out
    finally:
        for j in jobs:
            j.kill()
