"""A cluster in a box: N nodes on this machine, each a Linux network namespace with its own
address and host name, joined through a bridge in a switch namespace, links shaped with tc
(rate) and a user-space forwarder in place of the bridge (latency), and the bundled Open MPI
launching across them through a launch agent in place of ssh."""

import collections
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "agent")
FORWARDER = os.path.join(HERE, "delay.c")  # compiled into the box's run directory when used
PREFIX = "hfbox"
SUBNET = "10.213.0"  # node k is SUBNET.(k+1)/24; seen only inside the box's namespaces
TOOLS = ("ip", "unshare", "nsenter", "tc", "umount")
PROBE = "probe"  # available() builds a one-node box named PREFIX + PROBE

# A link profile. `rate` is a tc rate ("1gbit") or None: each node's link to the switch,
# both ways. `latency` is seconds or None: one way between any two nodes, every frame held
# that long by the forwarder (delay.c) that then replaces the bridge (this kernel has no
# netem).
Profile = collections.namedtuple("Profile", "rate latency")
PROFILES = {
    "unshaped": Profile(rate=None, latency=None),
    "1gbit": Profile(rate="1gbit", latency=None),
    "slow": Profile(rate="1gbit", latency=100e-6),
}


def _run(*argv, check=True):
    """Run a command; its stderr in the error when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip()}")
    return done


def _rate_bytes(rate):
    """Bytes per second of a tc rate such as "1gbit", "100mbit", "500kbit"."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return float(match.group(1)) * scale / 8


def names(prefix=PREFIX):
    """The box's run directory, and a regular expression matching its namespace names."""
    return f"/run/{prefix}", re.compile(rf"{re.escape(prefix)}-(switch|node\d+)")


def available(prefix=PREFIX):
    """(True, "") when boxes can be built here, else (False, the reason)."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return False, f"missing tools: {', '.join(missing)} (iproute2, util-linux)"
    probe = Box(nodes=1, profile="1gbit", prefix=prefix + PROBE)
    try:
        probe.build()
    except (RuntimeError, OSError) as e:
        return False, f"cannot build a namespace node here: {e}"
    finally:
        probe.close()
    return True, ""


def _namespace_ids(prefix):
    """(st_dev, st_ino) of every namespace of boxes named `prefix`."""
    run_dir, pattern = names(prefix)
    files = []
    if os.path.isdir("/run/netns"):
        files += [os.path.join("/run/netns", n) for n in os.listdir("/run/netns")
                  if pattern.fullmatch(n)]
    if os.path.isdir(run_dir):
        files += [os.path.join(run_dir, n) for n in os.listdir(run_dir) if n.endswith(".uts")]
    ids = set()
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_dev != os.stat(run_dir if path.endswith(".uts") else "/run/netns").st_dev:
            ids.add((st.st_dev, st.st_ino))  # a mounted namespace, not a bare placeholder
    return ids


def _processes_in(ids):
    """Pids of the processes (other than this one) in any namespace of `ids`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        for kind in ("net", "uts"):
            try:
                st = os.stat(f"/proc/{name}/ns/{kind}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in ids:
                pids.append(int(name))
                break
    return pids


def kill_all(ids, timeout=10.0):
    """SIGKILL every process in the namespaces `ids` until none is left; the pids killed."""
    killed = set()
    deadline = time.monotonic() + timeout
    while (pids := _processes_in(ids)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.05)
    return sorted(killed)


def _claim(prefix):
    """Hold the name `prefix` for this process, or None when a live process holds it. The
    claim is an abstract Unix socket: it leaves nothing on disk and ends with its process,
    also a killed one."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0hyparflow-box-{prefix}")
    except OSError:
        claim.close()
        return None
    return claim


def cleanup(prefix=PREFIX, force=False):
    """Remove every trace of boxes named `prefix` left by a crash or a killed run: their
    processes, namespaces, mounts, host files and Open MPI's leftovers; available()'s probe
    box too. Idempotent. A box still held by a live process is left alone unless `force`."""
    for name in (prefix, prefix + PROBE):
        claim = _claim(name)
        if claim is None and not force:
            raise RuntimeError(f"the box {name!r} belongs to a live process: "
                               f"cleanup(force=True) removes it anyway")
        try:
            _remove(name)
        finally:
            if claim is not None:
                claim.close()


def _remove(prefix):
    """Remove every trace of boxes named `prefix` (see cleanup)."""
    run_dir, pattern = names(prefix)
    kill_all(_namespace_ids(prefix))
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f]
    for point in reversed(mounts):  # the deepest first
        if point.startswith(run_dir + "/"):
            _run("umount", "-l", point, check=False)
    shutil.rmtree(run_dir, ignore_errors=True)
    if os.path.isdir("/run/netns"):
        for name in os.listdir("/run/netns"):
            if pattern.fullmatch(name):
                _run("ip", "netns", "delete", name, check=False)
    hosts = re.compile(rf"{re.escape(prefix)}-node\d+")
    if os.path.isdir("/etc/netns"):
        for name in os.listdir("/etc/netns"):
            if hosts.fullmatch(name):
                shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
    # Open MPI's session directories and shared-memory files carry the node's host name
    leftovers = re.compile(rf".*\.{re.escape(prefix)}-node\d+\..*")
    for where in ("/tmp", "/dev/shm"):
        try:
            entries = os.listdir(where)
        except OSError:
            continue
        for name in entries:
            if leftovers.fullmatch(name):
                path = os.path.join(where, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass


class Box:
    """`nodes` nodes named PREFIX-node0… (host name and namespace alike), each with one link
    to the switch shaped by `profile`; built on entering, removed on leaving.

        with Box(nodes=2, profile="1gbit") as box:
            argv, env = box.command("train.py", ranks_per_node=2)
            subprocess.run(argv, env=env)
    """

    def __init__(self, nodes=2, profile="unshaped", prefix=PREFIX, subnet=SUBNET):
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes={nodes}: expected 1 to 250")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,47}", prefix):
            raise ValueError(f"prefix {prefix!r}: expected up to 48 lowercase letters and digits")
        self.nodes, self.prefix, self.subnet = nodes, prefix, subnet
        self.profile = self._profile(profile)
        self.dir, _ = names(prefix)
        self.hosts = [f"{prefix}-node{k}" for k in range(nodes)]
        self.addresses = [f"{subnet}.{k + 1}" for k in range(nodes)]
        # locally administered, the address's four bytes: known to the forwarder in advance
        self.macs = ["02:00:" + ":".join(f"{int(b):02x}" for b in a.split("."))
                     for a in self.addresses]
        self.switch = f"{prefix}-switch"
        self.claim = None
        self.forwarder = None  # the running latency forwarder (a Popen), if any
        self.forwarder_report = []  # the last one's counts, a line per port, once stopped

    # --- building and removing ---------------------------------------------------------

    def build(self):
        """Create the switch and the nodes (whatever a killed run left is removed first)."""
        if self.claim is None:
            self.claim = _claim(self.prefix)
            if self.claim is None:
                raise RuntimeError(
                    f"a box named {self.prefix!r} is already in use (by a live process)")
        try:
            _remove(self.prefix)
            os.makedirs(self.dir, mode=0o755)
            sw = self.switch
            _run("ip", "netns", "add", sw)
            _run("ip", "-n", sw, "link", "set", "lo", "up")
            _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", sw, "link", "set", "br0", "up")
            hosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
                f"{a}\t{h}\n" for a, h in zip(self.addresses, self.hosts))
            for k, (host, address) in enumerate(zip(self.hosts, self.addresses)):
                _run("ip", "netns", "add", host)
                # both ends made where they live: the root namespace never sees an interface
                _run("ip", "-n", sw, "link", "add", f"port{k}", "type", "veth",
                     "peer", "name", "eth0", "address", self.macs[k], "netns", host)
                _run("ip", "-n", sw, "link", "set", f"port{k}", "master", "br0", "up")
                _run("ip", "-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
                _run("ip", "-n", host, "link", "set", "eth0", "up")
                _run("ip", "-n", host, "link", "set", "lo", "up")
                uts = os.path.join(self.dir, f"{host}.uts")
                open(uts, "w").close()
                _run("unshare", f"--uts={uts}", "hostname", host)
                os.makedirs(f"/etc/netns/{host}", exist_ok=True)
                with open(f"/etc/netns/{host}/hosts", "w") as f:
                    f.write(hosts)
            self.shape(self.profile)
        except BaseException:
            self.close()
            raise
        return self

    def close(self):
        """Remove the box: its processes (the forwarder first, stopped cleanly), namespaces,
        mounts and files."""
        if self.claim is not None:
            try:
                try:
                    self._stop_forwarder()
                finally:
                    _remove(self.prefix)
            finally:
                self.claim.close()
                self.claim = None

    def __enter__(self):
        return self.build()

    def __exit__(self, *exc):
        self.close()

    # --- links ----------------------------------------------------------------------------

    @staticmethod
    def _profile(profile):
        if isinstance(profile, str):
            if profile not in PROFILES:
                raise ValueError(f"profile {profile!r}: expected one of {', '.join(PROFILES)}")
            profile = PROFILES[profile]
        if profile.latency is not None and not 0 <= profile.latency <= 1:
            raise ValueError(f"latency {profile.latency!r}: expected seconds from 0 to 1")
        return profile

    def shape(self, profile):
        """Give every node's link `profile` (a name in PROFILES or a Profile): its rate both
        ways (the node's eth0 shapes what it sends, the switch port what it receives), its
        latency between nodes (the forwarder in place of the bridge, started or stopped)."""
        profile = self._profile(profile)
        self._stop_forwarder()  # before the ports rejoin the bridge: no frame forwarded twice
        for k, host in enumerate(self.hosts):
            for ns, dev in ((host, "eth0"), (self.switch, f"port{k}")):
                _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
                if profile.rate is not None:
                    rate = _rate_bytes(profile.rate)
                    # a burst of 1 ms at the rate (at least 64 KiB: one GSO packet) and up
                    # to 5 ms of queue before tail drop
                    burst = max(65536, int(rate / 1000))
                    _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", profile.rate, "burst", str(burst),
                         "limit", str(burst + int(rate * 0.005)))
        # a port both in the bridge and read by the forwarder would be forwarded twice
        bridge = ("nomaster",) if profile.latency is not None else ("master", "br0")
        for k in range(self.nodes):
            _run("ip", "-n", self.switch, "link", "set", f"port{k}", *bridge)
        if profile.latency is not None:
            self._start_forwarder(profile.latency)
        self.profile = profile

    # --- the forwarder (latency) ----------------------------------------------------------

    def _compile_forwarder(self):
        """The forwarder's executable, compiled from delay.c into the run directory once."""
        binary = os.path.join(self.dir, "delay")
        if os.path.exists(binary):
            return binary
        compiler = shutil.which(os.environ.get("CC", "gcc"))
        if compiler is None:
            raise RuntimeError(f"a profile with latency needs a C compiler to build its "
                               f"forwarder from {FORWARDER}: install gcc (or set CC)")
        _run(compiler, "-O2", "-Wall", "-Wextra", "-pthread", "-o", binary + ".tmp",
             FORWARDER)
        os.replace(binary + ".tmp", binary)
        return binary

    def _start_forwarder(self, latency, timeout=10.0):
        """Start the forwarder in the switch namespace between every port, holding each frame
        `latency` seconds; back once it has opened every port. It lives in the switch
        namespace: cleanup() kills it with the box's other processes after a killed run."""
        argv = (["ip", "netns", "exec", self.switch, self._compile_forwarder(),
                 str(round(latency * 1e9))]
                + [f"port{k}={mac}" for k, mac in enumerate(self.macs)])
        with open(os.path.join(self.dir, "delay.log"), "w") as log:  # counts when it stops
            self.forwarder = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                              stdout=subprocess.PIPE, stderr=log)
        ready = select.select([self.forwarder.stdout], [], [], timeout)[0]
        if not ready or self.forwarder.stdout.readline().strip() != b"ready":
            self._stop_forwarder()
            raise RuntimeError(f"the forwarder did not start ({shlex.join(argv)}): "
                               f"{' '.join(self.forwarder_report) or 'no word from it'}")

    def _stop_forwarder(self, timeout=5.0):
        """Stop the forwarder if one runs (SIGTERM: it writes its counts) and read its counts
        into forwarder_report."""
        if self.forwarder is None:
            return
        forwarder, self.forwarder = self.forwarder, None
        if forwarder.poll() is None:
            forwarder.terminate()
            try:
                forwarder.wait(timeout)
            except subprocess.TimeoutExpired:
                forwarder.kill()
                forwarder.wait()
        forwarder.stdout.close()
        try:
            with open(os.path.join(self.dir, "delay.log")) as log:
                self.forwarder_report = [line.strip() for line in log if line.strip()]
        except OSError:
            self.forwarder_report = []

    # --- running in the box ------------------------------------------------------------

    def enter(self, node=0):
        """The argv prefix that runs a command inside `node`, in the caller's environment."""
        host = self.hosts[node]
        return ["nsenter", f"--uts={self.dir}/{host}.uts", "--", "ip", "netns", "exec", host]

    def run(self, node, argv, **kwargs):
        """subprocess.run(argv) inside `node`."""
        return subprocess.run(self.enter(node) + list(argv), **kwargs)

    def hostfile(self, ranks_per_node):
        """A host file of every node with `ranks_per_node` slots (written once per count)."""
        path = os.path.join(self.dir, f"hostfile-{ranks_per_node}")
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                f.writelines(f"{h} slots={ranks_per_node}\n" for h in self.hosts)
            os.replace(path + ".tmp", path)
        return path

    def mpiexec_options(self, ranks_per_node, map_by=None):
        """Open MPI options that launch across the box, `ranks_per_node` ranks on each node
        (consecutive ranks on one node unless `map_by` says otherwise, e.g. "node")."""
        if " " in AGENT + self.dir:  # Open MPI splits the agent's command line at spaces
            raise ValueError(f"the launch agent's path may not hold a space: {AGENT}")
        options = ["--prtemca", "plm_ssh_agent", f"{AGENT} {self.dir}",
                   "--prtemca", "plm_ssh_no_tree_spawn", "1",
                   "--hostfile", self.hostfile(ranks_per_node),
                   "--map-by", map_by or f"ppr:{ranks_per_node}:node",
                   "--bind-to", "none"]
        if os.geteuid() == 0:
            options.insert(0, "--allow-run-as-root")
        return options

    def command(self, script, *args, ranks_per_node=2, python=None, mpiexec=None, env=None,
                extra=()):
        """(argv, env) that run `python script args` on nodes × ranks_per_node ranks, mpiexec
        started inside node 0. `env` holds variables for every rank (forwarded with -x: the
        agent gives other nodes a fresh login's environment); `script` may be "-c"."""
        python = python or sys.executable
        mpiexec = mpiexec or os.path.join(os.path.dirname(python), "mpiexec")
        full_env = dict(os.environ)
        forwards = []
        for name, value in (env or {}).items():
            full_env[name] = str(value)
            forwards += ["-x", name]
        argv = (self.enter(0) + [mpiexec, "-n", str(self.nodes * ranks_per_node)]
                + self.mpiexec_options(ranks_per_node) + forwards + list(extra)
                + [python, script] + [str(a) for a in args])
        return argv, full_env

    def _ids(self, node):
        host = self.hosts[node]
        ids = set()
        for path in (f"/run/netns/{host}", f"{self.dir}/{host}.uts"):
            st = os.stat(path)
            ids.add((st.st_dev, st.st_ino))
        return ids

    def processes(self, node):
        """{pid: command line} of the processes running in `node`."""
        found = {}
        for pid in _processes_in(self._ids(node)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:  # gone meanwhile
                pass
        return found

    def kill(self, node):
        """SIGKILL every process of `node` (a node failing); the pids killed."""
        return kill_all(self._ids(node))


if __name__ == "__main__":  # python box.py available | cleanup [PREFIX] [--force]
    what = sys.argv[1] if len(sys.argv) > 1 else "available"
    if what == "cleanup":
        words = [w for w in sys.argv[2:] if w != "--force"]
        cleanup(words[0] if words else PREFIX, force="--force" in sys.argv)
    else:
        ok, reason = available()
        print("available" if ok else f"not available: {reason}")
