"""Network namespaces, veth links and their shaping: the tools :mod:`~dask_kvstate.testing.hosts` builds hosts with.

Each call runs ``ip`` or ``tc`` as a subprocess with a deadline. Links are shaped with
``htb`` whose bucket holds about one packet, so a link sends at its rate from its first
byte, as a real link of that rate does: a ``tbf`` bucket of a few milliseconds of the
rate lets a short transfer through at veth speed, which makes short probes of a link read
it many times faster than it is (the measurements are in docs/design/transport.md).

Every name a run makes starts with :data:`PREFIX` and its owner's pid
(``kvh<pid>x<n>...``), so :func:`cleanup_stale` can delete what a killed run left.

Examples
--------
>>> isinstance(skip_reason(), (str, type(None)))
True
>>> rate_arg("10 Mbit/s"), rate_arg(None)
('10000000bit', None)
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping

from dask_kvstate.config import parse_bandwidth

PREFIX = "kvh"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, check=check, timeout=30)


@functools.cache
def skip_reason() -> str | None:
    """Why :class:`~dask_kvstate.testing.hosts.Hosts` cannot run on this machine, or ``None`` when it can (cached)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
        shape(probe, "a0", "10mbit")
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", "") or e
        return f"network namespaces, veth pairs or tc htb are unavailable here: {str(err).strip()[:200]}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def shape(ns: str, dev: str, rate: str | None) -> None:
    """``dev``'s egress at ``rate`` (tc's ``<bits>bit``), or unshaped (None)."""
    tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
    if rate is None:
        return
    tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    # burst and cburst of about one packet: no burst above the rate (the module docstring says why)
    klass = ["classid", "1:1", "htb", "rate", rate, "ceil", rate, "burst", "1600", "cburst", "1600"]
    tc(ns, "class", "add", "dev", dev, "parent", "1:", *klass)


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
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX) or "x" not in name:
            continue
        pid = name[len(PREFIX) :].split("x")[0]
        if not pid.isdigit() or alive(int(pid)):
            continue
        kill_namespace(name)
        removed.append(name)
    return removed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace(ns: str) -> None:
    for pid in ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", ns, check=False)
