"""A standby driver takes the job over by itself (docs/high-availability.md): the journal and
the leadership live in a real etcd (Debian's etcd-server, started here), a standby adopts the
workers when the leader's lease runs out, and a leader that lost its lease never acts again.
The oracles: /proc (which worker processes run), the workers' ledgers and the model's hash,
and etcd's own keys, read with its JSON API."""
import glob
import json
import os
import re
import shutil
import signal
import time

import pytest

from etcd_server import etcd_get, free_port, start_etcd, stop_etcd
from helpers import PY, Job, end_jobs as end, max_diff, procs_with_marker, py_env, run
import ledger
from netns_hosts import SUBNET, address, kill_namespace, namespace_hosts, namespace_processes, \
    sh, sshd_on

EPOCHS = 12
SAMPLES = 4096
TTL = 3
DIGITS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "examples", "train_digits.py")
DIGITS_SAMPLES = 1500  # its training split
TORCH_EPOCHS = 6


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """One etcd member on loopback, shared by the module's tests (each its own prefix); its
    client port."""
    members = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield members[0][1]
    stop_etcd(members)


def workers(marker):
    """The worker processes of the test (found in /proc: the marker and a slot)."""
    return sorted(p for p in procs_with_marker(marker) if slot_of(p))


def slot_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"ELASTIC_SLOT="):
            return item[len(b"ELASTIC_SLOT="):].decode()
    return None


def wait_workers(marker, n, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = workers(marker)
        if len(pids) >= n:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"{n} workers never started: {workers(marker)}")


def env_of(marker):
    return dict(os.environ, ELASTIC_TEST_MARK=marker)


def command(elastic_run, example, etcd, prefix, state, book, standby=False, epochs=EPOCHS,
            extra=(), ttl=TTL):
    endpoints = ",".join(f"127.0.0.1:{p}" for p in (etcd if isinstance(etcd, list) else [etcd]))
    return ([elastic_run] + (["--standby"] if standby else []) + list(extra) +
            ["--state-store", f"etcd://{endpoints}/{prefix}", "--lease-ttl", str(ttl),
             "--state-dir", str(state), "-np", "2", "--min-np", "1", "--driver-timeout", "60",
             example, "--epochs", str(epochs), "--step-ms", "10", "--ledger", book])


def leader_then_standby(elastic_run, example, etcd, prefix, state, book, marker,
                        standby_extra=()):
    """A leader trained past epoch 1, then a standby that waits for it; (leader, standby).
    The caller's end(marker) stops both, whatever happened."""
    leader = Job(command(elastic_run, example, etcd, prefix, state, book), env=env_of(marker))
    leader.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
    standby = Job(command(elastic_run, example, etcd, prefix, state, book, standby=True,
                          extra=standby_extra), env=env_of(marker))
    standby.wait_for(r"standby: the driver at .* leads the job", timeout=30)
    return leader, standby


def check_fault_free(book, text, fault_free_hash):
    assert f"hash {fault_free_hash}" in text, text
    # No rollback: the round went on through the failover, every sample once.
    problems = ledger.check(book, SAMPLES, EPOCHS, max_rollback=0)
    assert not problems, "\n".join(problems)


def test_a_standby_adopts_the_workers_of_a_killed_leader_and_the_job_ends_fault_free(
        elastic_run, example, etcd, fault_free_hash, tmp_path):
    marker = f"ha-kill-{os.getpid()}"
    prefix = f"test/kill-{os.getpid()}"
    state, book = tmp_path / "state", str(tmp_path / "ledger")
    leader = standby = None
    try:
        # The standby's options may differ from the leader's: here, an event log, and metrics
        # beyond loopback, which a job without TLS cannot have: served on loopback instead.
        leader, standby = leader_then_standby(
            elastic_run, example, etcd, prefix, state, book, marker,
            standby_extra=["--event-log", str(tmp_path / "standby.jsonl"), "--metrics-port",
                           "0", "--metrics-address", "0.0.0.0"])
        pids = wait_workers(marker, 2)
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait(10)
        standby.wait_for(r"this driver leads the job now", timeout=TTL + 30)
        standby.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        assert workers(marker) == pids  # the same processes: nothing started again
        standby.wait_for(r"the adopted job runs without TLS.*serving them on 127\.0\.0\.1")
        standby.wait_for(r"metrics on http://127\.0\.0\.1:\d+/metrics")
        value, _ = etcd_get(etcd, f"/{prefix}/leader")
        assert value.split("\n")[1] == str(standby.proc.pid), value
        assert standby.wait(timeout=120) == 0, standby.text()
    finally:
        end(marker, leader, standby)
    check_fault_free(book, leader.text() + "\n" + standby.text(), fault_free_hash)
    with open(tmp_path / "standby.jsonl") as f:
        evs = [json.loads(l) for l in f]
    resumed = [e for e in evs if e["event"] == "driver_resumed"]
    assert len(resumed) == 1 and resumed[0]["resumed"] and resumed[0]["lost"] == [], resumed
    assert [e["event"] for e in evs if e["event"] == "round_formed"] == []  # the round went on
    # The job's end is in the store, and no journal is left for a standby to adopt.
    done, _ = etcd_get(etcd, f"/{prefix}/done")
    assert json.loads(done)["code"] == 0, done
    assert etcd_get(etcd, f"/{prefix}/journal") == (None, 0)


def etcd_calls(port, method):
    """How many calls of `method` (Range, LeaseTimeToLive, ...) etcd has served: its own
    Prometheus counters, an oracle outside the product."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{")
               and f'grpc_method="{method}"' in line)


def test_workers_of_a_lost_leader_look_again_only_when_its_lease_can_have_run_out(
        elastic_run, example, fault_free_hash, tmp_path):
    """The workers of a killed leader look the job's leader up in etcd, find the same one
    with time left on its lease, and look again only when it may have run out: while the lease
    lives they leave etcd alone, by etcd's own counters. (Before, each worker looked at every
    commit it made: two workers made 346 lookups in 7 s, and 64 workers on 2 cores kept etcd
    busy enough to cost training a third of its rate; four a second would still be 40 in the
    5 s counted here.) A standby started after those 5 s still leads when the lease ends, the
    workers find it, and the job ends fault-free."""
    members = start_etcd(tmp_path / "etcd")
    port = members[0][1]
    marker, prefix = f"ha-lookups-{os.getpid()}", f"test/lookups-{os.getpid()}"
    state, book = tmp_path / "state", str(tmp_path / "ledger")
    # Renewed every 2.5 s, the lease ends 7.5 to 10 s after the kill (later renewals on a
    # loaded machine end it sooner): 5 s are counted, all within its life.
    ttl, counted = 10, 5
    leader = standby = None
    try:
        leader = Job(command(elastic_run, example, port, prefix, state, book, ttl=ttl),
                     env=env_of(marker))
        leader.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        pids = wait_workers(marker, 2)
        ranges, ttls = etcd_calls(port, "Range"), etcd_calls(port, "LeaseTimeToLive")
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait(10)
        time.sleep(counted)  # a window of time is what is measured here
        ranges, ttls = etcd_calls(port, "Range") - ranges, etcd_calls(port, "LeaseTimeToLive") - ttls
        assert ttls >= 2 and ranges <= 10, (ranges, ttls)
        standby = Job(command(elastic_run, example, port, prefix, state, book, standby=True,
                              ttl=ttl), env=env_of(marker))
        standby.wait_for(r"this driver leads the job now", timeout=ttl + 30)
        standby.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        assert standby.wait(timeout=120) == 0, standby.text()
    finally:
        end(marker, leader, standby)
        stop_etcd(members)
    check_fault_free(book, leader.text() + "\n" + standby.text(), fault_free_hash)
    # The same two processes trained to the end (they may finish while no driver leads): one
    # ledger each, none started again.
    assert sorted(int(p.rsplit(".", 1)[1]) for p in glob.glob(book + ".*")) == pids


def test_over_etcd_with_tls_a_standby_adopts_the_workers_and_the_job_ends_fault_free(
        elastic_run, example, fault_free_hash, tmp_path):
    """etcds://: the drivers and the workers reach an etcd that serves HTTPS only to clients
    with a certificate of its CA (--client-cert-auth). The leader is killed; the standby leads,
    the workers find it through that etcd (their lookups use the certificate they got with
    their launch) and the job ends fault-free. Plain etcd:// to it, and etcds:// without the
    client certificate, are refused."""
    certs = tmp_path / "certs"
    members = start_etcd(tmp_path / "etcd", certs=certs)
    port = members[0][1]
    marker = f"ha-tls-{os.getpid()}"
    prefix = f"test/tls-{os.getpid()}"
    state, book = tmp_path / "state", str(tmp_path / "ledger")
    tls = ["--state-store-ca", str(certs / "ca.pem"), "--state-store-cert",
           str(certs / "client.pem"), "--state-store-key", str(certs / "client.key")]

    def secure(args):
        at = args.index("--state-store") + 1
        args[at] = args[at].replace("etcd://", "etcds://")
        return args[:at + 1] + tls + args[at + 1:]

    leader = standby = None
    try:
        plain = command(elastic_run, example, port, prefix + "-plain", tmp_path / "s1",
                        book + "-plain", epochs=1)
        ca_only = command(elastic_run, example, port, prefix + "-ca-only", tmp_path / "s2",
                          book + "-ca-only", epochs=1)
        at = ca_only.index("--state-store") + 1
        ca_only[at] = ca_only[at].replace("etcd://", "etcds://")
        ca_only[at + 1:at + 1] = ["--state-store-ca", str(certs / "ca.pem")]
        for refused, says in ((plain, "does it serve HTTPS? give etcds://"),
                              (ca_only, "does it ask for a client certificate?")):
            rc, out = run(refused, timeout=60)
            assert rc == 1 and says in out, out
        # Bad arguments: the certificate options with a plain etcd, a key without its
        # certificate, a file that is not PEM (exit 2, saying which).
        for scheme, extra, says in (
                ("etcd://", ["--state-store-ca", str(certs / "ca.pem")],
                 "give an etcds:// --state-store"),
                ("etcds://", ["--state-store-key", str(certs / "client.key")], "go together"),
                ("etcds://", ["--state-store-ca", example], "not a PEM file")):
            args = list(plain)
            at = args.index("--state-store") + 1
            args[at] = args[at].replace("etcd://", scheme)
            args[at + 1:at + 1] = extra
            rc, out = run(args, timeout=60)
            assert rc == 2 and says in out, (extra, out)
        leader = Job(secure(command(elastic_run, example, port, prefix, state, book)),
                     env=env_of(marker))
        leader.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        standby = Job(secure(command(elastic_run, example, port, prefix, state, book,
                                     standby=True)), env=env_of(marker))
        standby.wait_for(r"standby: the driver at .* leads the job", timeout=30)
        pids = wait_workers(marker, 2)
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait(10)
        standby.wait_for(r"this driver leads the job now", timeout=TTL + 30)
        standby.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        assert workers(marker) == pids
        value, _ = etcd_get(port, f"/{prefix}/leader", certs=certs)
        assert value.split("\n")[1] == str(standby.proc.pid), value
        assert standby.wait(timeout=120) == 0, standby.text()
    finally:
        end(marker, leader, standby)
        stop_etcd(members)
    check_fault_free(book, leader.text() + "\n" + standby.text(), fault_free_hash)


def test_a_paused_leader_is_fenced_off_and_ends_without_touching_the_workers(
        elastic_run, example, etcd, fault_free_hash, tmp_path):
    """Split brain: the leader is paused (SIGSTOP) past its lease while the workers train; the
    standby leads; when the old leader runs again it must see it no longer leads and end (exit
    3), and the workers must follow the new one."""
    marker = f"ha-stop-{os.getpid()}"
    prefix = f"test/stop-{os.getpid()}"
    state, book = tmp_path / "state", str(tmp_path / "ledger")
    leader = standby = None
    try:
        leader, standby = leader_then_standby(elastic_run, example, etcd, prefix, state, book,
                                              marker)
        pids = wait_workers(marker, 2)
        os.kill(leader.proc.pid, signal.SIGSTOP)
        standby.wait_for(r"this driver leads the job now", timeout=TTL + 30)
        standby.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        os.kill(leader.proc.pid, signal.SIGCONT)
        assert leader.wait(timeout=30) == 3, leader.text()
        assert "no longer leads the job" in leader.text(), leader.text()
        assert workers(marker) == pids  # the old leader killed none of them
        value, _ = etcd_get(etcd, f"/{prefix}/leader")
        assert value.split("\n")[1] == str(standby.proc.pid), value
        assert standby.wait(timeout=120) == 0, standby.text()
    finally:
        end(marker, leader, standby)
    check_fault_free(book, standby.text(), fault_free_hash)


def test_a_second_leader_is_refused_and_a_standby_ends_with_the_job(
        elastic_run, example, etcd, tmp_path):
    marker = f"ha-two-{os.getpid()}"
    prefix = f"test/two-{os.getpid()}"
    state, book = tmp_path / "state", str(tmp_path / "ledger")
    leader = standby = None
    try:
        leader = Job(command(elastic_run, example, etcd, prefix, state, book, epochs=4),
                     env=env_of(marker))
        leader.wait_for(r"\[0\]<stdout>:epoch 0 done", timeout=60)
        rc, out = run(command(elastic_run, example, etcd, prefix, tmp_path / "other",
                              str(tmp_path / "other-ledger"), epochs=4), env=env_of(marker),
                      timeout=60)
        assert rc == 1, out
        assert f"pid {leader.proc.pid}" in out and "--standby" in out, out
        standby = Job(command(elastic_run, example, etcd, prefix, state, book, standby=True,
                              epochs=4), env=env_of(marker))
        standby.wait_for(r"standby: the driver at .* leads the job", timeout=30)
        assert leader.wait(timeout=120) == 0, leader.text()
        # The job ended under its leader: the standby has nothing to take over.
        assert standby.wait(timeout=30) == 0, standby.text()
        assert "the job ended under another driver" in standby.text(), standby.text()
    finally:
        end(marker, leader, standby)


@pytest.mark.parametrize("args,says", [
    (["--state-store", "http://127.0.0.1:2379/x", "--state-dir", "S"],
     "not an etcd:// or etcds:// URL"),
    (["--state-store", "etcd://127.0.0.1:2379", "--state-dir", "S"], "no /PREFIX"),
    (["--state-store", "etcd://127.0.0.1:99999/x", "--state-dir", "S"], "bad port"),
    (["--state-store", "etcd://127.0.0.1:2379/x"], "--state-store needs --state-dir"),
    (["--standby"], "--standby, --lease-ttl and --drivers need --state-store"),
    (["--drivers", "2"], "--standby, --lease-ttl and --drivers need --state-store"),
    (["--state-store", "etcd://127.0.0.1:2379/x", "--state-dir", "S", "--drivers", "10"],
     "--drivers: Value 10 not in range"),
    (["--state-store", "etcd://127.0.0.1:2379/x", "--state-dir", "S", "--drivers", "0"],
     "--drivers: Value 0 not in range"),
])
def test_bad_high_availability_arguments_are_refused_with_exit_2(elastic_run, tmp_path, args,
                                                                 says):
    args = [str(tmp_path / a) if a == "S" else a for a in args]
    rc, out = run([elastic_run] + args + ["-np", "1", "true"], timeout=30)
    assert rc == 2, out
    assert says in out, out


def test_a_leader_without_etcd_says_which_endpoints_did_not_answer(elastic_run, tmp_path):
    port = free_port()  # nothing listens there
    rc, out = run([elastic_run, "--state-store", f"etcd://127.0.0.1:{port}/x",
                   "--state-dir", str(tmp_path / "s"), "-np", "1", "true"], timeout=60)
    assert rc == 1, out
    assert f"no etcd endpoint of etcd://127.0.0.1:{port}/x answered" in out, out


def test_a_standby_of_another_program_is_refused_without_taking_the_lead(
        elastic_run, example, etcd, tmp_path):
    marker = f"ha-other-{os.getpid()}"
    prefix = f"test/other-{os.getpid()}"
    state, book = tmp_path / "state", str(tmp_path / "ledger")
    leader = None
    try:
        leader = Job(command(elastic_run, example, etcd, prefix, state, book, epochs=40),
                     env=env_of(marker))
        leader.wait_for(r"\[0\]<stdout>:epoch 0 done", timeout=60)
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait(10)
        # Once the killed leader's lease is gone, the journal is of another program's job:
        # refused before it leads.
        rc, out = run(command(elastic_run, example, etcd, prefix, state, book, standby=True,
                              epochs=41), env=env_of(marker), timeout=60)
        assert rc == 2, out
        assert "its job runs another program" in out, out
        assert etcd_get(etcd, f"/{prefix}/leader") == (None, 0)  # it never took the lead
    finally:
        end(marker, leader)


def test_one_etcd_member_lost_costs_nothing(elastic_run, example, fault_free_hash, tmp_path):
    """A three-member etcd; the member the driver talks to first is killed mid-job: the driver
    goes on with the others and still leads, and the job ends as a fault-free one. The lease
    (8 s) outlasts the election of a new etcd leader when the killed member led, on a loaded
    machine too (with 3 s, a CI run lost the lease while the two others elected one)."""
    members = start_etcd(tmp_path / "etcd", members=3)
    ports = [p for _, p in members]
    marker = f"ha-member-{os.getpid()}"
    prefix = f"test/member-{os.getpid()}"
    state, book = tmp_path / "state", str(tmp_path / "ledger")
    leader = None
    try:
        leader = Job(command(elastic_run, example, ports, prefix, state, book, ttl=8),
                     env=env_of(marker))
        leader.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=60)
        members[0][0].kill()
        members[0][0].wait()
        # The rest of the job (about 9 s, past a TTL): its lease was renewed through the
        # others, else it would have stepped down (exit 3).
        assert leader.wait(timeout=120) == 0, leader.text()
        assert "no longer leads" not in leader.text()
        done, _ = etcd_get(ports[1], f"/{prefix}/done")
        assert json.loads(done)["code"] == 0, done
    finally:
        end(marker, leader)
        stop_etcd(members)
    check_fault_free(book, leader.text(), fault_free_hash)


def test_etcd_gone_past_the_ttl_the_leader_steps_down_the_workers_train_on_and_a_standby_leads_after(
        elastic_run, example, fault_free_hash, tmp_path):
    members = start_etcd(tmp_path / "etcd")
    port = members[0][1]
    marker = f"ha-outage-{os.getpid()}"
    prefix = f"test/outage-{os.getpid()}"
    state, book = tmp_path / "state", str(tmp_path / "ledger")
    leader = standby = None
    try:
        leader, standby = leader_then_standby(elastic_run, example, port, prefix, state, book,
                                              marker)
        pids = wait_workers(marker, 2)
        os.kill(members[0][0].pid, signal.SIGSTOP)  # etcd answers nobody
        assert leader.wait(timeout=TTL + 30) == 3, leader.text()
        assert "no longer leads the job" in leader.text(), leader.text()
        # The workers train on with no driver (their epochs keep coming, shown by nobody:
        # counted in the ledger), and the standby waits for etcd.
        steps = ledger_lines(book)
        deadline = time.monotonic() + 30
        while ledger_lines(book) <= steps + 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ledger_lines(book) > steps + 50, "the workers stopped training"
        assert standby.proc.poll() is None, standby.text()
        os.kill(members[0][0].pid, signal.SIGCONT)
        standby.wait_for(r"this driver leads the job now", timeout=TTL + 30)
        standby.wait_for(r"2 worker\(s\) re-attached", timeout=30)
        assert workers(marker) == pids
        assert standby.wait(timeout=120) == 0, standby.text()
    finally:
        if members[0][0].poll() is None:
            os.kill(members[0][0].pid, signal.SIGCONT)
        end(marker, leader, standby)
        stop_etcd(members)
    check_fault_free(book, standby.text(), fault_free_hash)


def ledger_lines(prefix):
    """Steps written to the workers' ledgers so far (every rank's files)."""
    n = 0
    for path in glob.glob(prefix + ".*"):
        with open(path) as f:
            n += f.read().count("\n")
    return n


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="needs root and iproute2")
@pytest.mark.parametrize("fault", ["host-killed", "cut-off-from-etcd", "paused",
                                   "host-killed-etcd-on-three-hosts",
                                   "host-killed-with-a-pytorch-job"])
def test_a_standby_on_another_host_adopts_the_ssh_workers_of_a_lost_leader(
        elastic_run, example, fault_free_hash, tmp_path, fault):
    """Four namespace hosts: two with workers (launched over ssh), the leader's and the
    standby's; etcd on the bridge. host-killed: every process of the leader's host is killed.
    cut-off-from-etcd: the leader's host can reach its workers but not etcd (nftables drops
    its packets to etcd): the leader must step down by itself (exit 3) and the workers follow
    the new one. paused: the leader is stopped until the standby has adopted the workers,
    then continued: it ends (exit 3), and its ssh launches end with it, which must not end the
    workers (soak seed 266509692: its launches' watchers ended them, after their agents had
    removed the ride-out file). Each time the standby, on another host, must lead, attach to
    the same worker processes over ssh, and finish the job fault-free with them alone, leaving
    nothing on any host. host-killed-etcd-on-three-hosts: etcd is a three-member cluster, each
    member on a namespace host of its own, over TLS with client certificates (etcds://: the
    ssh workers get theirs on the launcher's stdin); the leader's host is killed, then, once
    the standby leads, one etcd member's host too: the job ends fault-free on the two members
    left (with an 8 s lease, which outlasts the election of a new etcd leader).
    host-killed-with-a-pytorch-job: a PyTorch job (examples/train_digits.py, its own leader
    on the same host and its own standby) trains beside the C++ one when the host is killed;
    both standbys lead, and the PyTorch job too ends with the same two worker processes, the
    exactly-once ledger and the model of a fault-free run."""
    cluster = fault == "host-killed-etcd-on-three-hosts"
    with_torch = fault == "host-killed-with-a-pytorch-job"
    ttl = 8 if cluster else TTL
    torch_book, saved = str(tmp_path / "torch-ledger"), str(tmp_path / "model.pt")
    hold = tmp_path / "hold"  # the PyTorch job waits for it before its last epoch
    if with_torch:  # the fault-free model, first: two local workers, no fault
        reference = str(tmp_path / "fault-free.pt")
        rc, out = run([elastic_run, "-np", "2", PY, DIGITS, "--epochs", str(TORCH_EPOCHS),
                       "--save", reference], env=py_env(), timeout=300)
        assert rc == 0, out
    with namespace_hosts(7 if cluster else 4) as names, \
            sshd_on(names[:2], tmp_path) as (addrs, key):
        certs, store_tls = None, []
        if cluster:
            certs = tmp_path / "certs"
            members = start_etcd(tmp_path / "etcd", members=3, certs=certs,
                                 namespaces=[(names[i], address(i)) for i in (4, 5, 6)])
            etcd_hosts = [address(i) for i in (4, 5, 6)]
            store_tls = ["--state-store-ca", str(certs / "ca.pem"), "--state-store-cert",
                         str(certs / "client.pem"), "--state-store-key", str(certs / "client.key")]
        else:
            members = start_etcd(tmp_path / "etcd", host=f"{SUBNET}.1")
            etcd_hosts = [f"{SUBNET}.1"]
        port = members[0][1]
        endpoints = ",".join(f"{h}:{p}" for h, (_, p) in zip(etcd_hosts, members))
        store = f"etcd{'s' if cluster else ''}://{endpoints}/host-test"
        book = str(tmp_path / "ledger")

        def driver(i, standby=False, torch=False):
            if torch:  # one worker on each host
                job = [store + "-torch", f"state{i}-torch", "2", ",".join(addrs), PY, DIGITS,
                       "--epochs", str(TORCH_EPOCHS), "--step-ms", "40", "--ledger",
                       torch_book, "--save", saved, "--hold-file", str(hold)]
            else:
                job = [store, f"state{i}", "4", ",".join(f"{a}:2" for a in addrs), example,
                       "--epochs", str(EPOCHS), "--step-ms", "10", "--ledger", book]
            return Job(["ip", "netns", "exec", names[i], elastic_run] +
                       (["--standby"] if standby else []) +
                       ["--state-store", job[0]] + store_tls + ["--lease-ttl",
                        str(ttl), "--state-dir", str(tmp_path / job[1]), "-np", job[2],
                        "--min-np", "1", "--driver-timeout", "60", "-H", job[3],
                        "--driver-address", address(i),
                        "--ssh-port", "2222", "--ssh-identity-file", key] + job[4:],
                       env=py_env())

        leader = standby = torch_leader = torch_standby = None
        try:
            if with_torch:  # first, so that the C++ job (seconds long) is mid-training too
                torch_leader = driver(2, torch=True)
                torch_leader.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=120)
                torch_standby = driver(3, standby=True, torch=True)
                torch_standby.wait_for(r"standby: the driver at .* leads the job", timeout=30)
                torch_pids = namespace_processes(names[:2], os.path.basename(PY))
                assert len(torch_pids) == 2, torch_pids
            leader = driver(2)
            leader.wait_for(r"\[0\]<stdout>:epoch 1 done", timeout=90)
            standby = driver(3, standby=True)
            standby.wait_for(r"standby: the driver at .* leads the job", timeout=30)
            pids = namespace_processes(names[:2], "logistic_regression")
            assert len(pids) == 4, pids
            if fault.startswith("host-killed"):
                kill_namespace(names[2])  # the leader's host, every process of it
            elif fault == "paused":
                os.kill(leader.proc.pid, signal.SIGSTOP)
            else:
                nft = ["ip", "netns", "exec", names[2], "nft"]
                sh(*nft, "add", "table", "inet", "cut")
                sh(*nft, "add", "chain", "inet", "cut", "out",
                   "{ type filter hook output priority 0; }")
                sh(*nft, "add", "rule", "inet", "cut", "out", "ip", "daddr", f"{SUBNET}.1",
                   "tcp", "dport", str(port), "drop")
                assert leader.wait(timeout=TTL + 30) == 3, leader.text()
                assert "no longer leads the job" in leader.text(), leader.text()
            standby.wait_for(r"this driver leads the job now", timeout=ttl + 30)
            standby.wait_for(r"4 worker\(s\) re-attached", timeout=60)
            if cluster:
                kill_namespace(names[4])  # an etcd member's host
            if fault == "paused":
                os.kill(leader.proc.pid, signal.SIGCONT)
                assert leader.wait(timeout=30) == 3, leader.text()
            assert namespace_processes(names[:2], "logistic_regression") == pids
            value, _ = etcd_get(members[-1][1], "/host-test/leader", host=etcd_hosts[-1],
                                certs=certs)
            assert value.startswith(address(3) + ":"), value
            assert standby.wait(timeout=120) == 0, standby.text()
            if with_torch:
                torch_standby.wait_for(r"this driver leads the job now", timeout=ttl + 30)
                torch_standby.wait_for(r"2 worker\(s\) re-attached", timeout=60)
                assert namespace_processes(names[:2], os.path.basename(PY)) == torch_pids
                hold.touch()
                assert torch_standby.wait(timeout=180) == 0, torch_standby.text()
        finally:
            for job in (leader, standby, torch_leader, torch_standby):
                if job:
                    job.kill()
            stop_etcd(members)
        check_fault_free(book, standby.text(), fault_free_hash)
        if with_torch:
            problems = ledger.check(torch_book, DIGITS_SAMPLES, TORCH_EPOCHS, max_rollback=0)
            assert not problems, "\n".join(problems)
            assert max_diff(saved, reference) < 1e-4
        # The same four processes trained to the end: one ledger each, none started again.
        assert len(glob.glob(book + ".*")) == 4, glob.glob(book + ".*")
        deadline = time.monotonic() + 15
        while namespace_processes(names) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert namespace_processes(names) == []


def wait_file(path, pattern, timeout):
    """Waits until the file holds a line matching `pattern`; its text."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        if any(rx.search(line) for line in text.splitlines()):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{path}: no line matching {pattern!r}; it holds:\n{text}")


def standbys_in(names):
    """{namespace: [pids]} of the elastic-run processes started with --standby, from /proc."""
    out = {}
    for ns in names:
        for pid in namespace_processes([ns], "elastic-run"):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"--standby" in argv:
                out.setdefault(ns, []).append(pid)
    return out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="needs root and iproute2")
def test_drivers_2_places_a_standby_that_outlives_the_leaders_host_and_places_the_next(
        elastic_run, example, fault_free_hash, tmp_path):
    """--drivers 2, nothing started by hand: the leader (on a host of its own) starts a standby
    over ssh on a host of the job; the leader's whole host is killed; the standby it placed
    (which outlived it: a session of its own on its host) leads, attaches to the same four
    worker processes, starts the next standby on the job's other host, and ends the job
    fault-free; that standby then ends with the job, and nothing is left on any host. The
    oracles: /proc (which processes run in which namespace), the standbys' own log files,
    etcd's keys and the workers' ledgers."""
    with namespace_hosts(3) as names, sshd_on(names[:2], tmp_path) as (addrs, key):
        members = start_etcd(tmp_path / "etcd", host=f"{SUBNET}.1")
        port = members[0][1]
        store = f"etcd://{SUBNET}.1:{port}/placed"
        book, state = str(tmp_path / "ledger"), tmp_path / "state"
        job_file = str(tmp_path / "leader.json")
        leader = Job(["ip", "netns", "exec", names[2], elastic_run, "--drivers", "2",
                      "--job-file", job_file, "--metrics-port", "9400",
                      "--state-store", store, "--lease-ttl", str(TTL), "--state-dir", str(state),
                      "-np", "4", "--min-np", "1", "--driver-timeout", "60",
                      "-H", ",".join(f"{a}:2" for a in addrs), "--driver-address", address(2),
                      "--ssh-port", "2222", "--ssh-identity-file", key, example,
                      "--epochs", str(EPOCHS), "--step-ms", "20", "--ledger", book],
                     env=py_env())
        try:
            placed = leader.wait_for(r"--drivers: started a standby driver on (\S+) \(pid (\d+)",
                                     timeout=90)[0]
            first, first_pid = placed.group(1), int(placed.group(2))
            assert first in addrs, leader.text()
            first_ns, other = names[addrs.index(first)], addrs[1 - addrs.index(first)]
            log = os.path.join(state, f"driver-{first}.log")
            wait_file(log, r"standby: the driver at .* leads the job", timeout=30)
            # It runs on the host it was placed on, and there alone; the leader's status says
            # so once it has counted it (every half TTL).
            assert standbys_in(names) == {first_ns: [first_pid]}
            deadline = time.monotonic() + 30
            while True:
                rc, out = run(["ip", "netns", "exec", names[2], elastic_run, "status",
                               "--job-file", job_file, "--json"], timeout=30)
                assert rc == 0, out
                standbys = json.loads(out)["standbys"]
                if standbys["waiting"] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert standbys["wanted"] == 1, standbys
            assert [(w["address"], w["pid"]) for w in standbys["waiting"]] == \
                [(first, first_pid)], standbys
            rc, metrics = run(["ip", "netns", "exec", names[2], "curl", "-sS",
                               "http://127.0.0.1:9400/metrics"], timeout=30)
            assert rc == 0, metrics
            assert "\nelastic_standby_drivers 1\n" in metrics, metrics
            assert "\nelastic_standby_drivers_wanted 1\n" in metrics, metrics
            pids = namespace_processes(names[:2], "logistic_regression")
            assert len(pids) == 4, pids
            kill_namespace(names[2])  # the leader's host, every process of it
            wait_file(log, r"this driver leads the job now", timeout=TTL + 30)
            wait_file(log, r"4 worker\(s\) re-attached", timeout=60)
            assert namespace_processes(names[:2], "logistic_regression") == pids
            value, _ = etcd_get(port, "/placed/leader", host=f"{SUBNET}.1")
            assert value.startswith(first + ":"), value
            # The new leader keeps two drivers: the next standby goes to the other host.
            text = wait_file(log, r"--drivers: started a standby driver on " + re.escape(other),
                             timeout=60)
            second_log = os.path.join(state, f"driver-{other}.log")
            wait_file(second_log, r"standby: the driver at .* leads the job", timeout=30)
            text = wait_file(log, r"elastic-run: success", timeout=120)
            done, _ = etcd_get(port, "/placed/done", host=f"{SUBNET}.1")
            assert json.loads(done)["code"] == 0, done
            # The second standby ends with the job, with its code.
            wait_file(second_log, r"standby: the job ended under another driver", timeout=30)
            deadline = time.monotonic() + 15
            while namespace_processes(names) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert namespace_processes(names) == []
        finally:
            leader.kill()
            stop_etcd(members)
        check_fault_free(book, text, fault_free_hash)
        assert len(glob.glob(book + ".*")) == 4, glob.glob(book + ".*")
