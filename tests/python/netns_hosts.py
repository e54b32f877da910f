"""Several hosts on one machine for the tests: network namespaces with their own addresses,
joined by a bridge whose address is the driver's, and an sshd in each (its own keys and config).
Only addresses made here are used (SUBNET, a private /24 that exists only on these bridges)."""
import contextlib
import os
import shutil
import signal
import subprocess
import uuid

import pytest

# ELASTIC_TEST_SUBNET (e.g. 10.213.78) lets a second test session run beside one that uses the
# default: the addresses of the two then never meet.
SUBNET = os.environ.get("ELASTIC_TEST_SUBNET", "10.213.77")


def sh(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def address(i):
    """The address of the i-th namespace host (SUBNET.1 is the bridge's)."""
    return f"{SUBNET}.{11 + i}"


@contextlib.contextmanager
def namespace_hosts(n):
    """n namespaces on a bridge; their names. Skips the test where namespaces are not
    available; removes them, and every process in them, at the end."""
    tag = uuid.uuid4().hex[:6]
    bridge, names = f"elbr{tag}", [f"el{tag}h{i + 1}" for i in range(n)]
    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        for i, ns in enumerate(names):
            veth, peer = f"elv{tag}{i}", f"elp{tag}{i}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            sh("ip", "link", "set", peer, "netns", ns)
            sh("ip", "link", "set", veth, "master", bridge)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address(i)}/24", "dev", peer)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", peer, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"network namespaces unavailable: {e.stderr.decode().strip()}")
    try:
        yield names
    finally:
        for ns in names:
            kill_namespace(ns)
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", bridge], stderr=subprocess.DEVNULL)


def kill_namespace(ns):
    """SIGKILL of every process in the namespace (a host that dies)."""
    pids = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                          text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def sshd_on(hosts, tmp_path):
    """An sshd in each namespace host (port 2222, its own keys and config under tmp_path);
    (their addresses, the client key). Skips where openssh-server is not installed."""
    if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("openssh-server is not installed")
    key = tmp_path / "client_key"
    host_key = tmp_path / "host_key"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key))
    (tmp_path / "authorized_keys").write_text((tmp_path / "client_key.pub").read_text())
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    procs = []
    for i, ns in enumerate(hosts):
        addr = address(i)
        cfg = tmp_path / f"sshd_{i}.conf"
        cfg.write_text(f"""ListenAddress {addr}
Port 2222
HostKey {host_key}
AuthorizedKeysFile {tmp_path}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {tmp_path}/sshd_{i}.pid
""")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e",
                                       "-f", str(cfg)], stderr=subprocess.DEVNULL))
    addrs = [address(i) for i in range(len(hosts))]
    try:
        # Wait (bounded) until each accepts a login.
        for addr in addrs:
            for _ in range(100):
                ok = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o",
                                     "StrictHostKeyChecking=no", "-o", "ConnectTimeout=2", "-p",
                                     "2222", "-i", str(key), addr, "true"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if ok.returncode == 0:
                    break
            else:
                # sshd is installed and the namespaces work: a login that fails is a failure.
                pytest.fail(f"sshd in the namespace at {addr} does not accept logins")
        yield addrs, str(key)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def namespace_processes(hosts, name=None):
    """The processes in the hosts' network namespaces (sshd aside), or those running the
    program `name` (argv[0]), from /proc: the oracle for which workers run and what is left."""
    out = []
    for ns in hosts:
        for pid in subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                                  text=True).stdout.split():
            try:
                argv0 = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode()
            except OSError:
                continue
            prog = os.path.basename(argv0)
            if prog != "sshd" and not argv0.startswith("sshd:") and name in (None, prog):
                out.append(int(pid))
    return sorted(out)
