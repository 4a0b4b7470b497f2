"""Several hosts on one machine: network namespaces on a bridge, with real, shaped TCP links.

:class:`Hosts` builds, as root, one network namespace per host, each joined by a veth
pair to a hub namespace that holds a bridge, plus one unshaped veth pair from the root
namespace to the hub so the test's own client (in the root namespace) reaches every
host. Each host's link is shaped with ``tbf`` on both ends of its veth pair: the host
end's egress is the host's upload, the hub end's egress its download (ingress shaping
would need an ``ifb`` device, which these machines may lack). A pull from host A to
host B therefore runs at ``min(rate A, rate B)``. A scheduler runs in host ``s`` and a
worker in each host ``w0``, ``w1``, ... as real ``dask scheduler`` / ``dask worker``
processes started with ``ip netns exec``.

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544), one /24 per run,
and every name carries the run's prefix (``kvh<pid>x<n>``) so runs in parallel never
collide. Everything is torn down on exit, on an exception, and at interpreter exit; a
later run deletes what a killed run left behind (namespaces whose owning pid is gone).

:func:`skip_reason` says why the harness cannot run here (not root, no ``ip`` or
``tc``, no namespace support), for ``pytest.skip``; ``None`` when it can.

Examples
--------
>>> isinstance(skip_reason(), (str, type(None)))
True
>>> rate_arg("10 Mbit/s"), rate_arg(None)
('10000000bit', None)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from dask_kvstate.config import parse_bandwidth

PREFIX = "kvh"
_COUNTER = itertools.count()
SCHEDULER_PORT = 8786


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, check=check, timeout=30)


@functools.cache
def skip_reason() -> str | None:
    """Why :class:`Hosts` cannot run on this machine, or ``None`` when it can (cached)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
        _tc(probe, "qdisc", "replace", "dev", "a0", "root", "tbf", "rate", "10mbit", "burst", "16kb", "latency", "50ms")
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", "") or e
        return f"network namespaces, veth pairs or tc tbf are unavailable here: {str(err).strip()[:200]}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def rate_arg(rate: str | float | None) -> str | None:
    """A rate (``"10 Mbit/s"`` or bytes/s) as ``tc``'s ``<bits>bit``; None stays None (unshaped)."""
    bps = parse_bandwidth(rate) if isinstance(rate, str) else rate
    return None if bps is None else f"{round(bps * 8)}bit"


def env_for(config: Mapping[str, object]) -> dict[str, str]:
    """Dask config as the ``DASK_*`` environment variables a child process reads.

    >>> env_for({"distributed.comm.timeouts.connect": "5s"})
    {'DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT': '5s'}
    """
    return {"DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v) for k, v in config.items()}


def cleanup_stale() -> list[str]:
    """Delete namespaces (and kill their processes) left by harness runs whose process is gone."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX) or "x" not in name:
            continue
        pid = name[len(PREFIX) :].split("x")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        _kill_namespace(name)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(ns: str) -> None:
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)


@dataclass
class Host:
    """One host: its namespace, address, link (veth ends) and the rate it is shaped to."""

    name: str  # "s", "w0", "w1", ...
    ns: str
    addr: str
    hub_end: str  # the veth end in the hub namespace
    rate: str | float | None = None
    proc: subprocess.Popen | None = None
    log: str = ""

    @property
    def port(self) -> int:
        return SCHEDULER_PORT if self.name == "s" else 9000


@dataclass
class Hosts:
    """A scheduler host and ``n_workers`` worker hosts as namespaces on a bridge (a context manager).

    Parameters
    ----------
    n_workers
        Worker hosts ``w0 ... w{n-1}``, each running one ``dask worker --nthreads 1``.
    rates
        ``{host name: rate}`` (``"10 Mbit/s"`` or bytes/s) for shaped links; others unshaped.
    config
        Dask config for the scheduler and worker processes (as environment variables).
    worker_args, scheduler_args
        Extra command-line arguments for every worker / the scheduler (TLS options, ...).
    start_timeout
        Seconds for the scheduler to listen and every worker to register.
    """

    n_workers: int = 2
    rates: Mapping[str, str | float | None] = field(default_factory=dict)
    config: Mapping[str, object] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    scheme: str = "tcp"
    start_timeout: float = 60.0
    hosts: dict[str, Host] = field(default_factory=dict, init=False)

    def __post_init__(self):
        self.run = f"{PREFIX}{os.getpid()}x{next(_COUNTER)}"
        self.hub = f"{self.run}hub"
        self.logdir = tempfile.mkdtemp(prefix=f"{self.run}-")
        self._up = False

    # --- building and tearing down -------------------------------------------------------

    def __enter__(self) -> Hosts:
        reason = skip_reason()
        if reason:
            raise RuntimeError(f"cannot build hosts: {reason}")
        cleanup_stale()
        atexit.register(self.close)
        try:
            self._build_network()
            self._start_processes()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def scheduler_address(self) -> str:
        s = self.hosts["s"]
        return f"{self.scheme}://{s.addr}:{s.port}"

    @property
    def workers(self) -> dict[str, str]:
        """``{host name: worker address}`` for every worker host."""
        return {h.name: f"{self.scheme}://{h.addr}:{h.port}" for h in self.hosts.values() if h.name != "s"}

    def _subnet(self) -> str:
        """A /24 of 198.18.0.0/15 that no route of the root namespace uses yet."""
        taken = _ip("route", "show", check=False).stdout
        start = os.getpid() * 7 + next(_COUNTER)
        for k in range(512):
            idx = (start + k) % 510 + 1
            net = f"198.{18 + idx // 256}.{idx % 256}"
            if f"{net}.0/24" not in taken:
                return net
        raise RuntimeError("every /24 of 198.18.0.0/15 is routed already")

    def _build_network(self) -> None:
        net = self._subnet()
        _ip("netns", "add", self.hub)
        self._up = True
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        # the root namespace's way in: an unshaped link to the hub, for the test's client
        root_end = f"{self.run}r"[-15:]
        _ip("link", "add", root_end, "type", "veth", "peer", "name", "root", "netns", self.hub)
        _ip("addr", "add", f"{net}.1/24", "dev", root_end)
        _ip("link", "set", root_end, "up")
        self._attach("root")
        names = ["s"] + [f"w{i}" for i in range(self.n_workers)]
        for i, name in enumerate(names):
            host = Host(name, f"{self.run}{name}", f"{net}.{i + 2}", f"h{name}", self.rates.get(name))
            _ip("netns", "add", host.ns)
            _ip("-n", host.ns, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", host.hub_end, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")
            self._attach(host.hub_end)
            self.hosts[name] = host
            self.set_rate(name, host.rate)

    def _attach(self, end: str) -> None:
        _ip("-n", self.hub, "link", "set", end, "master", "br0")
        _ip("-n", self.hub, "link", "set", end, "up")

    def _spawn(self, host: Host, args: list[str]) -> None:
        env = {**os.environ, **env_for(self.config), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        host.log = os.path.join(self.logdir, f"{host.name}.log")
        with open(host.log, "wb") as out:
            host.proc = subprocess.Popen(
                ["ip", "netns", "exec", host.ns, sys.executable, "-m", "dask", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: killed as one
            )

    def _start_processes(self) -> None:
        s = self.hosts["s"]
        self._spawn(
            s,
            [
                "scheduler",
                "--host",
                s.addr,
                "--port",
                str(s.port),
                "--no-dashboard",
                *self._preload,
                *self.scheduler_args,
            ],
        )
        self._wait_listening(s)
        for host in self.hosts.values():
            if host.name != "s":
                self._spawn(host, self._worker_command(host))

    def _worker_command(self, host: Host) -> list[str]:
        return [
            "worker",
            self.scheduler_address,
            "--host",
            host.addr,
            "--worker-port",
            str(host.port),
            "--nthreads",
            "1",
            "--no-nanny",
            "--no-dashboard",
            "--name",
            host.name,
            *self._preload,
            *self.worker_args,
        ]

    _preload = ("--preload", "dask_kvstate.plugins")

    def _wait_listening(self, host: Host) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if host.proc is not None and host.proc.poll() is not None:
                raise RuntimeError(f"{host.name} exited ({host.proc.returncode}):\n{self.log_tail(host.name)}")
            with contextlib.suppress(OSError), socket.create_connection((host.addr, host.port), timeout=1):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{host.name} did not listen on {host.addr}:{host.port}:\n{self.log_tail(host.name)}")

    def close(self) -> None:
        """Kill every process and delete every namespace and link of this run (idempotent, never raises)."""
        for host in self.hosts.values():
            self._stop(host)
        if self._up:
            for host in self.hosts.values():
                _kill_namespace(host.ns)
            _kill_namespace(self.hub)  # takes the root namespace's end of its link with it
            self._up = False
        atexit.unregister(self.close)

    def _stop(self, host: Host) -> None:
        if host.proc is not None and host.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(host.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.proc.wait(timeout=10)

    # --- what tests do to hosts ----------------------------------------------------------

    def set_rate(self, name: str, rate: str | float | None) -> None:
        """Shape host ``name``'s link to ``rate`` both ways (``None``: unshaped)."""
        host = self.hosts[name]
        host.rate = rate
        arg = rate_arg(rate)
        for ns, dev in ((host.ns, "eth0"), (self.hub, host.hub_end)):
            if arg is None:
                _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
                continue
            # a burst of ~5 ms of the rate (at least 16 KiB): tbf needs a few packets of
            # bucket to reach its rate, and a small one keeps short probes honest
            burst = max(int(parse_bandwidth(rate) if isinstance(rate, str) else rate or 0) // 200, 16384)  # type: ignore[arg-type]
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", arg, "burst", str(burst), "latency", "50ms")

    def link_down(self, name: str) -> None:
        """Cut host ``name`` off (its veth's hub end down): its packets are dropped, its sockets hang."""
        _ip("-n", self.hub, "link", "set", self.hosts[name].hub_end, "down")

    def link_up(self, name: str) -> None:
        """Reconnect host ``name``."""
        _ip("-n", self.hub, "link", "set", self.hosts[name].hub_end, "up")

    def restart_worker(self, name: str) -> None:
        """Kill host ``name``'s worker process and start a fresh one (same address)."""
        host = self.hosts[name]
        self._stop(host)
        self._spawn(host, self._worker_command(host))

    def log_tail(self, name: str, chars: int = 4000) -> str:
        """The end of host ``name``'s process output."""
        try:
            with open(self.hosts[name].log, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        except OSError:
            return ""

    def client(self, **kwargs):
        """A ``distributed.Client`` of this run's scheduler (in the root namespace), once every worker joined."""
        from distributed import Client

        client = Client(self.scheduler_address, **{"timeout": self.start_timeout, **kwargs})
        try:
            client.wait_for_workers(self.n_workers, timeout=self.start_timeout)
        except BaseException:
            tails = "\n".join(f"--- {n}\n{self.log_tail(n, 1500)}" for n in self.hosts)
            client.close()
            raise TimeoutError(f"workers did not all join:\n{tails}") from None
        return client
