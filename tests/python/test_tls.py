"""The control plane's TLS (--tls, docs/security.md) on the wire: a capture on the bridge of
namespace hosts (tcpdump, an oracle outside the product) shows neither the job token nor the
job's state of a job whose driver the workers dial beyond loopback, and shows both once the
job runs with --tls off (so the capture would see them). A client without the job's
credentials, a plain-text client and a replayed call are refused; /metrics beyond loopback
asks for the job's client certificate and token. Needs root, iproute2 and tcpdump."""
import json
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import time

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

    def __init__(self, interface, path, expression=()):
        self.path = path
        self.proc = subprocess.Popen(
            ["tcpdump", "-i", interface, "--immediate-mode", "-U", "-n", "-s", "0", "-w", str(path),
             *expression],
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


def tcp_streams(pcap, port):
    """{client port: the bytes the client sent to `port`, in order} for each TCP connection to
    `port` whose opening (SYN) the capture holds: a small reader of pcap files (Ethernet or
    Linux cooked frames, IPv4), independent of the product."""
    magic, = struct.unpack("<I", pcap[:4])
    endian = "<" if magic in (0xa1b2c3d4, 0xa1b23c4d) else ">"
    link, = struct.unpack(endian + "I", pcap[20:24])
    skip = {1: 14, 113: 16, 276: 20}[link]  # Ethernet, SLL, SLL2
    segments, opened, at = {}, set(), 24
    while at + 16 <= len(pcap):
        incl, = struct.unpack(endian + "I", pcap[at + 8:at + 12])
        frame = pcap[at + 16:at + 16 + incl]
        at += 16 + incl
        ip = frame[skip:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        total = struct.unpack(">H", ip[2:4])[0]
        tcp = ip[(ip[0] & 15) * 4:total]
        src, dst, seq = struct.unpack(">HHI", tcp[:8])
        flags, payload = tcp[13], tcp[(tcp[12] >> 4) * 4:]
        if dst != port:
            continue
        if flags & 0x02:  # SYN: the data starts at seq + 1
            opened.add(src)
            segments[src] = {"isn": seq, "data": {}}
        elif src in opened and payload:
            segments[src]["data"][(seq - segments[src]["isn"] - 1) % 2**32] = payload
    streams = {}
    for src, s in segments.items():
        data = b""
        for offset in sorted(s["data"]):  # a retransmission overlaps what is there
            chunk = s["data"][offset]
            if offset + len(chunk) > len(data):
                data += chunk[max(0, len(data) - offset):]
        streams[src] = data
    return streams


def replay(port, data, wanted, timeout=10):
    """Sends `data` on a new connection to 127.0.0.1:`port`; (what comes back until `wanted`
    shows in it, the server closes, or `timeout` seconds pass; whether the server closed)."""
    got, closed = b"", False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        deadline = time.monotonic() + timeout
        while wanted not in got and time.monotonic() < deadline:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            got += chunk
    return got, closed


@pytest.mark.parametrize("tls", ["on", "off"])
def test_a_replayed_call_is_refused_with_tls(elastic_run, test_worker, tmp_path, tls):
    """A call of `elastic-run status`, captured on loopback and sent again byte for byte on a
    new connection: with --tls off the driver answers it again (the job's state in clear);
    with TLS the replayed handshake cannot finish (the server's fresh random makes its keys
    new), and nothing of the job comes back."""
    job_file = tmp_path / "job.json"
    job = Job([elastic_run, "-np", "1", "--tls", tls, "--job-file", str(job_file), test_worker,
               "sleep"])
    try:
        job.wait_for(r"sleeping pid \d+", timeout=60)
        port = int(json.loads(job_file.read_text())["address"].rsplit(":", 1)[1])
        capture = Capture("lo", tmp_path / "lo.pcap", ["tcp", "port", str(port)])
        try:
            rc, out = run([elastic_run, "status", "--job-file", str(job_file), "--json"],
                          timeout=60)
        finally:
            seen = capture.stop()
        assert rc == 0 and '"members"' in out, out
        streams = tcp_streams(seen, port)
        assert len(streams) == 1, streams.keys()  # the status call's connection alone
        call = next(iter(streams.values()))
        assert len(call) > 100, call
        answer, closed = replay(port, call, b'"members"')
        if tls == "off":
            assert b'"members"' in answer, answer
        else:  # the driver ends the connection at the replayed client's Finished
            assert closed and b'"members"' not in answer and b"localhost" not in answer, answer
        # The driver still answers a real client afterwards.
        rc, out = run([elastic_run, "status", "--job-file", str(job_file)], timeout=60)
        assert rc == 0 and out.startswith("job: "), out
    finally:
        job.kill()


def https_get(port, path, ca=None, cert=None, key=None, token=None):
    """GET `path` from 127.0.0.1:`port` over TLS as elastic-run-driver's client: (status code,
    body); an ssl.SSLError or OSError when the handshake is refused."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="elastic-run-driver") as sock:
            auth = f"Authorization: Bearer {token}\r\n" if token else ""
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: elastic-run-driver\r\n{auth}"
                         "Connection: close\r\n\r\n".encode())
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    if not head:
        raise ConnectionError("no HTTP answer")
    return int(head.split()[1]), body.decode(errors="replace")


def test_metrics_beyond_loopback_ask_for_the_jobs_client_certificate_and_token(
        elastic_run, test_worker, tmp_path):
    """--metrics-address 0.0.0.0: /metrics and /status over HTTPS with the driver's certificate;
    answered with a client certificate of the job's CA and the job token (what `elastic-run
    credentials` writes, mode 0600); 401 without the token; the handshake refused without the
    certificate or with another job's; plain HTTP gets no answer. Without TLS such an address
    is refused with exit 2."""
    rc, out = run([elastic_run, "-np", "1", "--tls", "off", "--metrics-port", "0",
                   "--metrics-address", "0.0.0.0", test_worker, "sleep"], timeout=60)
    assert rc == 2 and "give --tls on, or a loopback --metrics-address" in out, out
    files = [tmp_path / "job.json", tmp_path / "other.json"]
    jobs = [Job([elastic_run, "-np", "1", "--tls", "on", "--metrics-port", "0",
                 "--metrics-address", "0.0.0.0", "--job-file", str(f), test_worker, "sleep"])
            for f in files]
    try:
        for j in jobs:
            j.wait_for(r"sleeping pid \d+", timeout=60)
        port = int(jobs[0].wait_for(r"metrics on https://[^:]+:(\d+)/metrics")[0].group(1))
        creds, other = tmp_path / "creds", tmp_path / "other-creds"
        for f, d in ((files[0], creds), (files[1], other)):
            rc, out = run([elastic_run, "credentials", "--job-file", str(f), "--out", str(d)],
                          timeout=60)
            assert rc == 0 and "client certificate and key" in out, out
        for name in ("token", "ca.pem", "client.pem", "client.key"):
            assert (creds / name).stat().st_mode & 0o777 == 0o600, name
        assert (creds / "token").read_text() == json.loads(files[0].read_text())["token"]
        mine = dict(ca=str(creds / "ca.pem"), cert=str(creds / "client.pem"),
                    key=str(creds / "client.key"))
        token = (creds / "token").read_text()
        code, body = https_get(port, "/metrics", token=token, **mine)
        assert code == 200 and "elastic_world_size" in body, body
        code, body = https_get(port, "/status", token=token, **mine)
        assert code == 200 and '"members"' in body, body
        code, body = https_get(port, "/metrics", token=token[:-1] + "x", **mine)
        assert code == 401 and "job token" in body, body
        code, body = https_get(port, "/metrics", **mine)
        assert code == 401, body
        with pytest.raises((ssl.SSLError, OSError)):
            https_get(port, "/metrics", ca=str(creds / "ca.pem"), token=token)
        with pytest.raises((ssl.SSLError, OSError)):  # another job's client certificate
            https_get(port, "/metrics", ca=str(creds / "ca.pem"), cert=str(other / "client.pem"),
                      key=str(other / "client.key"), token=token)
        answer, _ = replay(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"world_size")
        assert b"world_size" not in answer, answer
    finally:
        for j in jobs:
            j.kill()
