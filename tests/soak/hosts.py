"""Where the soak's workers run, and the host-level faults it can inject there.

LocalHosts: two host names of this machine ("localhost" and "127.0.0.1").
NetnsHosts: three network namespaces joined by a bridge, each a host with its own address;
workers start in them through --launcher-template 'ip netns exec {host} sh -c {command}'.
Faults: a whole host killed (every process in its namespace), its link down for a few seconds
then up, random packet loss (nftables in the namespace), a bandwidth cap (tc tbf), and a
partition from the other hosts but not from the driver. Only addresses it creates are used.
"""
import os
import signal
import subprocess
import uuid


class Discovery:
    """A discovery script that prints a host file, or misbehaves as its mode file says."""

    def __init__(self, folder, slots):
        self.hosts = folder / "hosts.txt"
        self.mode = folder / "mode"
        self.script = folder / "discover.sh"
        self.script.write_text(
            "#!/bin/sh\n"
            f"case $(cat {self.mode} 2>/dev/null) in\n"
            "  fail) echo 'cloud API down' >&2; exit 3 ;;\n"
            "  hang) sleep 30 ;;\n"
            "  garbage) echo '%% not a host list %%' ;;\n"
            f"  *) cat {self.hosts} ;;\n"
            "esac\n")
        self.script.chmod(0o755)
        self.slots = dict(slots)
        self.write()
        self.set_mode("good")

    def write(self):
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}:{n}\n" for h, n in self.slots.items() if n > 0))
        os.replace(tmp, self.hosts)

    def set_mode(self, mode):
        tmp = self.mode.with_suffix(".tmp")
        tmp.write_text(mode)
        os.replace(tmp, self.mode)

    def total(self):
        return sum(self.slots.values())

    def listed(self, slot):
        """Whether the slot ("host:index") is within its host's listed slots now."""
        host, _, index = slot.rpartition(":")
        return int(index) < self.slots.get(host, 0)


class LocalHosts:
    names = ["localhost", "127.0.0.1"]  # two host names, both this machine
    first_slots = {"localhost": 2, "127.0.0.1": 1}
    faults = {}
    driver_hosts = []  # the drivers run here, on this machine
    store_address = "127.0.0.1"  # where the soak's etcd listens (--standby)

    def launcher_args(self, driver_host=None):
        return []

    def driver_command(self, driver_host):
        return []

    def up(self):
        pass

    def down(self):
        pass

    def heal(self):
        pass


def sh(*args, check=True):
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout


class NetnsHosts:
    """Three namespace hosts on a bridge. The driver listens on the bridge's address."""

    SUBNET = None  # a private /24 that exists only on this soak's bridge (free_subnet)
    first_slots = None  # set in __init__
    # Host faults and their weights, added to the soak's mix.
    faults = {"host-kill": 10, "link-flap": 12, "loss": 12, "cap": 10, "partition": 12}

    def __init__(self, count=3, drivers=0):
        self.SUBNET = self.free_subnet()
        tag = uuid.uuid4().hex[:6]
        self.tag = tag
        self.bridge = f"esbr{tag}"
        self.names = [f"es{tag}h{i}" for i in range(count)]
        # Hosts of the drivers alone (--standby): the leader's and its standby's; no worker
        # runs there, and host faults never pick them (driver-host-kill does).
        self.driver_hosts = [f"es{tag}d{i}" for i in range(drivers)]
        every = self.names + self.driver_hosts
        self.veth = {n: f"esv{tag}{i}" for i, n in enumerate(every)}
        self.peer = {n: f"esp{tag}{i}" for i, n in enumerate(every)}
        self.addr = {n: f"{self.SUBNET}.{11 + i}" for i, n in enumerate(every)}
        self.store_address = f"{self.SUBNET}.1"
        self.first_slots = {n: 1 for n in self.names}
        self.first_slots[self.names[0]] = 2
        self.impaired = {}  # host -> the fault that holds it now

    @staticmethod
    def free_subnet():
        """A 10.213.X.0/24 no interface of this machine has (two soaks at once, or one killed
        before it cleaned up, must not share a subnet: replies would take the wrong bridge)."""
        used = sh("ip", "-o", "-4", "addr", "show", check=False)
        for x in range(91, 131):
            if f"10.213.{x}." not in used:
                return f"10.213.{x}"
        raise RuntimeError("no free 10.213.X.0/24 for the namespace hosts")

    def launcher_args(self, driver_host=None):
        """The driver listens on the bridge's address, or on its own host's."""
        where = self.addr[driver_host] if driver_host else f"{self.SUBNET}.1"
        return ["--driver-address", where,
                "--launcher-template", "ip netns exec {host} sh -c {command}"]

    def driver_command(self, driver_host):
        """What runs a driver on its own host (nothing: on this machine's root namespace)."""
        return ["ip", "netns", "exec", driver_host] if driver_host else []

    def up(self):
        """Makes the bridge and the namespaces; raises RuntimeError naming what failed."""
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.SUBNET}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for n in self.names + self.driver_hosts:
            sh("ip", "netns", "add", n)
            sh("ip", "link", "add", self.veth[n], "type", "veth", "peer", "name", self.peer[n])
            sh("ip", "link", "set", self.peer[n], "netns", n)
            sh("ip", "link", "set", self.veth[n], "master", self.bridge)
            sh("ip", "link", "set", self.veth[n], "up")
            sh("ip", "netns", "exec", n, "ip", "addr", "add", f"{self.addr[n]}/24", "dev",
               self.peer[n])
            sh("ip", "netns", "exec", n, "ip", "link", "set", self.peer[n], "up")
            sh("ip", "netns", "exec", n, "ip", "link", "set", "lo", "up")
            # One table per host for the soak's packet faults; empty until a fault fills it.
            sh("ip", "netns", "exec", n, "nft", "add", "table", "inet", "soak")
            for chain, hook in (("in", "input"), ("out", "output")):
                sh("ip", "netns", "exec", n, "nft", "add", "chain", "inet", "soak", chain,
                   f"{{ type filter hook {hook} priority 0; }}")

    def pids(self, host):
        return [int(p) for p in sh("ip", "netns", "pids", host, check=False).split()]

    def kill_host(self, host):
        """Every process of the host dies at once (a power loss)."""
        n = 0
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
                n += 1
            except ProcessLookupError:
                pass
        return n > 0

    def impair(self, host, kind, rng):
        """Starts a lasting fault on `host`; heal(host) ends it. Returns a description."""
        ns = ["ip", "netns", "exec", host]
        if kind == "link-flap":
            sh("ip", "link", "set", self.veth[host], "down")
            what = "link down"
        elif kind == "loss":
            pct = rng.randint(1, 10)
            for chain in ("in", "out"):
                sh(*ns, "nft", "add", "rule", "inet", "soak", chain, "numgen", "random", "mod",
                   "100", "<", str(pct), "drop")
            what = f"{pct} % packet loss"
        elif kind == "cap":
            mbit = rng.choice([1, 2, 4, 8])
            sh(*ns, "tc", "qdisc", "add", "dev", self.peer[host], "root", "tbf", "rate",
               f"{mbit}mbit", "burst", "32kbit", "latency", "400ms")
            what = f"bandwidth capped at {mbit} Mbit/s"
        elif kind == "partition":
            others = ", ".join(self.addr[o] for o in self.names if o != host)
            sh(*ns, "nft", "add", "rule", "inet", "soak", "in", "ip", "saddr", f"{{ {others} }}",
               "drop")
            sh(*ns, "nft", "add", "rule", "inet", "soak", "out", "ip", "daddr", f"{{ {others} }}",
               "drop")
            what = "cut off from the other hosts (not from the driver)"
        else:
            raise ValueError(kind)
        self.impaired[host] = kind
        return what

    def heal(self, host=None):
        for h in ([host] if host else list(self.impaired)):
            kind = self.impaired.pop(h, None)
            if kind == "link-flap":
                sh("ip", "link", "set", self.veth[h], "up", check=False)
            elif kind in ("loss", "partition"):
                for chain in ("in", "out"):
                    sh("ip", "netns", "exec", h, "nft", "flush", "chain", "inet", "soak", chain,
                       check=False)
            elif kind == "cap":
                sh("ip", "netns", "exec", h, "tc", "qdisc", "del", "dev", self.peer[h], "root",
                   check=False)

    def down(self):
        self.heal()
        for n in self.names + self.driver_hosts:
            for pid in self.pids(n):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", n, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
