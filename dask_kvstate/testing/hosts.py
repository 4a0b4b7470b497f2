"""Several hosts on one machine: network namespaces on a bridge, with real, shaped TCP links.

:class:`Hosts` builds, as root, one network namespace per host, each joined by a veth
pair to a hub namespace that holds a bridge, plus one unshaped veth pair from the root
namespace to the hub so the test's own client (in the root namespace) reaches every
host. Each host's link is shaped with ``htb`` on both ends of its veth pair: the host
end's egress is the host's upload, the hub end's egress its download (ingress shaping
would need an ``ifb`` device, which these machines may lack). A pull from host A to
host B therefore runs at ``min(rate A, rate B)``, from its first byte
(:mod:`~dask_kvstate.testing.netns`). A scheduler runs in host ``s`` and a
worker in each host ``w0``, ``w1``, ... as real ``dask scheduler`` / ``dask worker``
processes started with ``ip netns exec``.

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544), one /24 per run,
and every name carries the run's prefix (``kvh<pid>x<n>``) so runs in parallel never
collide. Everything is torn down on exit, on an exception, and at interpreter exit; a
later run deletes what a killed run left behind (namespaces whose owning pid is gone).

:func:`skip_reason` says why the harness cannot run here (not root, no ``ip`` or
``tc``, no namespace support), for ``pytest.skip``; ``None`` when it can.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from dask_kvstate.testing.netns import (
    PREFIX,
    cleanup_stale,
    env_for,
    ip,
    kill_namespace,
    rate_arg,
    shape,
    skip_reason,
)
from dask_kvstate.testing.tls import TLSFiles, throwaway_ca

__all__ = ["Host", "Hosts", "skip_reason"]

_COUNTER = itertools.count()
SCHEDULER_PORT = 8786


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
        Extra command-line arguments for every worker / the scheduler.
    tls
        Speak TLS everywhere (``tls://`` addresses, encryption required): a throwaway CA
        and a certificate it signed for every host (:mod:`~dask_kvstate.testing.tls`),
        passed to each process as ``--tls-ca-file``, ``--tls-cert`` and ``--tls-key`` and
        to :meth:`client` as its ``security``; deleted on :meth:`close`.
    start_timeout
        Seconds for the scheduler to listen and every worker to register. A worker's
        kvstate plugin loads its model before it registers: on two cores busy with another
        test's vLLM engine, one took over 60 s (a deadline only; a start takes 5-40 s).
    """

    n_workers: int = 2
    rates: Mapping[str, str | float | None] = field(default_factory=dict)
    config: Mapping[str, object] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    tls: bool = False
    start_timeout: float = 180.0
    hosts: dict[str, Host] = field(default_factory=dict, init=False)
    tls_files: TLSFiles | None = field(default=None, init=False)

    def __post_init__(self):
        self.run = f"{PREFIX}{os.getpid()}x{next(_COUNTER)}"
        self.hub = f"{self.run}hub"
        self.logdir = tempfile.mkdtemp(prefix=f"{self.run}-")
        self.scheme = "tls" if self.tls else "tcp"
        self._up = False

    # --- building and tearing down -------------------------------------------------------

    def __enter__(self) -> Hosts:
        reason = skip_reason()
        if reason:
            raise RuntimeError(f"cannot build hosts: {reason}")
        cleanup_stale()
        atexit.register(self.close)
        self._on_sigterm()
        try:
            self._build_network()
            if self.tls:
                folder = os.path.join(self.logdir, "tls")
                self.tls_files = throwaway_ca(folder, [h.addr for h in self.hosts.values()] + [self._root_addr])
            self._start_processes()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_sigterm(self) -> None:
        """Make SIGTERM (``timeout``, a CI runner giving up) unwind, so teardown runs: its
        default ends the interpreter without ``finally`` blocks or atexit handlers."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:

            def stop(signum, frame):
                raise SystemExit(128 + signum)

            signal.signal(signal.SIGTERM, stop)

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
        taken = ip("route", "show", check=False).stdout
        start = os.getpid() * 7 + next(_COUNTER)
        for k in range(512):
            idx = (start + k) % 510 + 1
            net = f"198.{18 + idx // 256}.{idx % 256}"
            if f"{net}.0/24" not in taken:
                return net
        raise RuntimeError("every /24 of 198.18.0.0/15 is routed already")

    def _build_network(self) -> None:
        net = self._subnet()
        ip("netns", "add", self.hub)
        self._up = True
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        # the root namespace's way in: an unshaped link to the hub, for the test's client
        root_end = f"{self.run}r"[-15:]
        ip("link", "add", root_end, "type", "veth", "peer", "name", "root", "netns", self.hub)
        self._root_addr = f"{net}.1"
        ip("addr", "add", f"{self._root_addr}/24", "dev", root_end)
        ip("link", "set", root_end, "up")
        self._attach("root")
        names = ["s"] + [f"w{i}" for i in range(self.n_workers)]
        for i, name in enumerate(names):
            host = Host(name, f"{self.run}{name}", f"{net}.{i + 2}", f"h{name}", self.rates.get(name))
            ip("netns", "add", host.ns)
            ip("-n", host.ns, "link", "set", "lo", "up")
            ip("-n", self.hub, "link", "add", host.hub_end, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            ip("-n", host.ns, "link", "set", "eth0", "up")
            self._attach(host.hub_end)
            self.hosts[name] = host
            self.set_rate(name, host.rate)

    def _attach(self, end: str) -> None:
        ip("-n", self.hub, "link", "set", end, "master", "br0")
        ip("-n", self.hub, "link", "set", end, "up")

    def _spawn(self, host: Host, args: list[str]) -> None:
        env = {**os.environ, **env_for(self.config), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        host.log = os.path.join(self.logdir, f"{host.name}.log")
        with open(host.log, "ab") as out:  # a restarted process's output follows its predecessor's
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
                *self._tls_args,
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
            *self._tls_args,
            *self.worker_args,
        ]

    _preload = ("--preload", "dask_kvstate.plugins")

    @property
    def _tls_args(self) -> tuple[str, ...]:
        return self.tls_files.cli_args() if self.tls_files is not None else ()

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
                kill_namespace(host.ns)
            kill_namespace(self.hub)  # takes the root namespace's end of its link with it
            self._up = False
        if self.tls_files is not None:  # the key of a throwaway CA's certificate: never left behind
            shutil.rmtree(os.path.dirname(self.tls_files.key), ignore_errors=True)
            self.tls_files = None
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
        for ns, dev in ((host.ns, "eth0"), (self.hub, host.hub_end)):
            shape(ns, dev, rate_arg(rate))

    def link_down(self, name: str) -> None:
        """Cut host ``name`` off (its veth's hub end down): its packets are dropped, its sockets hang."""
        ip("-n", self.hub, "link", "set", self.hosts[name].hub_end, "down")

    def link_up(self, name: str) -> None:
        """Reconnect host ``name``."""
        ip("-n", self.hub, "link", "set", self.hosts[name].hub_end, "up")

    def restart_worker(self, name: str) -> None:
        """Kill host ``name``'s worker process and start a fresh one (same address)."""
        host = self.hosts[name]
        self._stop(host)
        self._spawn(host, self._worker_command(host))

    def wait_exit(self, name: str, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for host ``name``'s process to end: its exit code, or None while it runs."""
        proc = self.hosts[name].proc
        assert proc is not None, f"{name} was never started"
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=timeout)
        return None

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

        if self.tls_files is not None:
            kwargs.setdefault("security", self.tls_files.security())
        client = Client(self.scheduler_address, **{"timeout": self.start_timeout, **kwargs})
        try:
            client.wait_for_workers(self.n_workers, timeout=self.start_timeout)
        except BaseException:
            tails = "\n".join(f"--- {n}\n{self.log_tail(n, 1500)}" for n in self.hosts)
            client.close()
            raise TimeoutError(f"workers did not all join:\n{tails}") from None
        return client
