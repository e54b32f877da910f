"""A real etcd for tests, benchmarks and the soak (Debian's etcd-server): members started on
free loopback ports, and its JSON API read directly (the oracle, independent of the product's
etcd client in common/etcd.cc)."""
import base64
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

CERTS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "etcd_tls_certs.sh")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_call(port, path, body, host="127.0.0.1", certs=None):
    """POST to etcd's JSON API; over HTTPS with the client certificate of `certs` (a folder
    of tests/etcd_tls_certs.sh) when given."""
    scheme, context = "http", None
    if certs:
        scheme = "https"
        context = ssl.create_default_context(cafile=os.path.join(certs, "ca.pem"))
        context.load_cert_chain(os.path.join(certs, "client.pem"),
                                os.path.join(certs, "client.key"))
    req = urllib.request.Request(f"{scheme}://{host}:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5, context=context) as r:
        return json.loads(r.read())


def etcd_get(port, key, host="127.0.0.1", certs=None):
    """The key's value (text) and its lease id, or (None, 0). A member that answers 503 (its
    cluster is electing a leader: a member was just lost) is asked again, for up to 20 s."""
    deadline = time.monotonic() + 20
    while True:
        try:
            got = etcd_call(port, "/v3/kv/range",
                            {"key": base64.b64encode(key.encode()).decode()}, host, certs)
            break
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    if not got.get("kvs"):
        return None, 0
    kv = got["kvs"][0]
    return base64.b64decode(kv.get("value", "")).decode(), int(kv.get("lease", 0))


def start_etcd(data, members=1, host="127.0.0.1", certs=None, namespaces=None):
    """`members` etcd members on `host` (an address of this machine: loopback, or a test's
    bridge), one cluster; [(process, client port)]. With `certs` (a folder), its clients speak
    HTTPS and must present a client certificate: tests/etcd_tls_certs.sh makes both there.
    With `namespaces`, [(network namespace, its address)] one per member: member i runs in
    namespace i on its address (hosts of their own; the members' addresses are then those,
    not `host`)."""
    binary = shutil.which("etcd")
    assert binary, "etcd is not installed: scripts/setup-deps.sh installs Debian's etcd-server"
    data.mkdir(parents=True, exist_ok=True)
    hosts = [addr for _, addr in namespaces] if namespaces else [host] * members
    assert len(hosts) == members, (namespaces, members)
    tls = []
    scheme = "http"
    if certs:
        subprocess.run(["sh", CERTS_SCRIPT, str(certs)] + sorted(set(hosts)), check=True)
        scheme = "https"
        tls = [f"--cert-file={certs}/server.pem", f"--key-file={certs}/server.key",
               f"--trusted-ca-file={certs}/ca.pem", "--client-cert-auth"]
    for _ in range(5):
        ports = [(free_port(), free_port()) for _ in range(members)]
        cluster = ",".join(f"m{i}=http://{hosts[i]}:{p}" for i, (_, p) in enumerate(ports))
        procs = []
        for i, (client, peer) in enumerate(ports):
            at = hosts[i]
            where = ["ip", "netns", "exec", namespaces[i][0]] if namespaces else []
            procs.append(subprocess.Popen(
                where + [binary, "--data-dir", str(data / f"m{i}"), "--name", f"m{i}",
                         "--listen-client-urls", f"{scheme}://{at}:{client}",
                         "--advertise-client-urls", f"{scheme}://{at}:{client}",
                         "--listen-peer-urls", f"http://{at}:{peer}",
                         "--initial-advertise-peer-urls", f"http://{at}:{peer}",
                         "--initial-cluster", cluster, "--initial-cluster-state", "new"] + tls,
                stdout=open(data / f"m{i}.log", "w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        up = set()
        while time.monotonic() < deadline and len(up) < members and all(
                p.poll() is None for p in procs):
            for i, (client, _) in enumerate(ports):
                try:
                    etcd_call(client, "/v3/kv/range", {"key": "eA=="}, hosts[i], certs)
                    up.add(i)
                except OSError:
                    pass
            time.sleep(0.1)
        if len(up) == members:
            return [(p, c) for p, (c, _) in zip(procs, ports)]
        for p in procs:  # a port taken meanwhile: again, elsewhere
            p.kill()
            p.wait()
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
    raise AssertionError("etcd did not start: " + "".join(
        f.read_text()[-1000:] for f in data.glob("*.log")))


def stop_etcd(members):
    for proc, _ in members:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
