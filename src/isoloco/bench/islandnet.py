"""Islands on a real slow link: Linux network namespaces joined by a bridge, each island's
egress shaped by the kernel's token-bucket filter.

    with IslandNet(islands=2, rate_mbit=10) as net:
        subprocess.run(net.argv(0, ["python", "-c", "..."]))     # runs inside island 0
        net.kernel_bytes(0)                                        # what island 0 sent

Island k is the namespace `isoloco-<pid>-<k>` holding one end of a veth pair, `isl<k>`, at
10.77.0.<k+1>/24; the other end sits on a bridge in the namespace `isoloco-<pid>-hub`. Nothing is
created in the namespace the caller runs in: the addresses live only on these links, and the only
route in an island is its own /24, so no traffic leaves for an address this module did not make.
Each island's egress is `tc qdisc ... tbf rate R` (a FIFO behind the token bucket, as a router's
queue is); the hub forwards at veth speed. netem is not used (it is often not built), so a link
has no added delay: latency stays the cost model's.

Cleanup happens three ways: leaving the `with` block (also by an exception, Ctrl-C or SIGTERM,
which `IslandNet` turns into an exception while it is up); a reaper process, started with the
namespaces, which removes them when this process dies in any way (it waits for the end of a pipe
only this process holds); and at the next start, namespaces of a process that no longer exists
are removed (`remove_leftovers`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from types import FrameType

from isoloco.errors import UsageError

PREFIX = "isoloco-"
SUBNET = "10.77.0"
#: Ethernet + IPv4 + TCP with timestamps: the bytes a packet adds to what TCP carries.
PACKET_HEADER_BYTES = 14 + 20 + 32
#: The shaper's queue, as time at the rate (tbf's `latency`): packets beyond it are dropped.
QUEUE_MS = 2000


class NamespacesUnavailable(UsageError):
    """This machine (or user) cannot make network namespaces: not root, or no `ip`/`tc`."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, in one line, or None when they can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the real-link harness needs iproute2's {' and '.join(missing)} (Debian: apt install iproute2)"
    if os.geteuid() != 0:
        return "the real-link harness makes network namespaces, which needs root (run it as root, e.g. with sudo)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here ({made.stderr.strip()}); the real-link harness needs network namespaces"
    _ip("netns", "del", probe, check=False)
    return None


def require_namespaces() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise NamespacesUnavailable(reason)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owned_namespaces(tag: str | None = None) -> list[str]:
    """The harness's namespaces now present (those of `tag` alone, if given)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.startswith(PREFIX)]
    return [n for n in names if tag is None or n.startswith(f"{PREFIX}{tag}-")]


def remove_namespaces(names: list[str]) -> None:
    """Stop every process inside `names`, then delete them (their veth ends go with them)."""
    for name in names:
        pids = _ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for name in names:
        _ip("netns", "del", name, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of harness processes that no longer run (killed before they could
    clean up); returns their names."""
    stale = []
    for name in owned_namespaces():
        match = re.match(rf"{PREFIX}(\d+)-", name)
        if match and not _alive(int(match.group(1))):
            stale.append(name)
    remove_namespaces(stale)
    return stale


class IslandNet:
    """N island namespaces around a bridge, each island's egress shaped to `rate_mbit`."""

    def __init__(self, islands: int, rate_mbit: float | None, queue_ms: float = QUEUE_MS) -> None:
        if not 2 <= islands <= 250:
            raise UsageError(f"islands={islands} is not allowed: the real-link harness makes 2 to 250 islands")
        if rate_mbit is not None and rate_mbit <= 0:
            raise UsageError(f"rate {rate_mbit} Mbit/s is not allowed: give a positive rate")
        self.islands = islands
        self.rate_mbit = rate_mbit
        self.queue_ms = queue_ms
        self.tag = str(os.getpid())
        self._reaper: subprocess.Popen | None = None
        self._handlers: dict[int, object] = {}

    # -- names -------------------------------------------------------------------------------

    def namespace(self, island: int) -> str:
        return f"{PREFIX}{self.tag}-{island}"

    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.tag}-hub"

    @staticmethod
    def interface(island: int) -> str:
        """The island's end of its link, inside its namespace (GLOO_SOCKET_IFNAME)."""
        return f"isl{island}"

    @staticmethod
    def address(island: int) -> str:
        return f"{SUBNET}.{island + 1}"

    # -- life --------------------------------------------------------------------------------

    def __enter__(self) -> IslandNet:
        require_namespaces()
        remove_leftovers()
        self._trap_signals()
        try:
            self._start_reaper()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        remove_namespaces(owned_namespaces(self.tag))
        if self._reaper is not None:
            self._reaper.stdin.close()  # its cue: nothing is left for it to remove
            self._reaper.wait()
            self._reaper = None
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers = {}

    def _trap_signals(self) -> None:
        """SIGTERM (and SIGHUP) end the block as Ctrl-C does, so `close` runs."""
        def stop(signum: int, _: FrameType | None) -> None:
            raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._handlers[signum] = signal.signal(signum, stop)

    def _start_reaper(self) -> None:
        # Its own session: a Ctrl-C to this terminal's process group does not stop it first.
        self._reaper = subprocess.Popen([sys.executable, "-m", "isoloco.bench.islandnet", "reap", self.tag],
                                        stdin=subprocess.PIPE, start_new_session=True)

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for k in range(self.islands):
            ns, hub_end = self.namespace(k), f"hub{k}"
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", self.interface(k), "netns", ns, "type", "veth", "peer", "name", hub_end,
                "netns", self.hub)
            _ip("-n", self.hub, "link", "set", hub_end, "master", "br0")
            _ip("-n", self.hub, "link", "set", hub_end, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", self.interface(k))
            _ip("-n", ns, "link", "set", self.interface(k), "up")
            self.shape(k, self.rate_mbit)

    # -- the link ----------------------------------------------------------------------------

    def shape(self, island: int, rate_mbit: float | None) -> None:
        """Set island `island`'s egress rate (also mid-run); None leaves it at veth speed, behind a
        plain FIFO that still counts what it sends."""
        if rate_mbit is None:
            qdisc = ["pfifo", "limit", "10000"]
        else:
            # tbf needs a bucket of at least one packet; at high rates a few ms of tokens keep it at rate.
            burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))
            qdisc = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{self.queue_ms}ms"]
        subprocess.run(["ip", "netns", "exec", self.namespace(island), "tc", "qdisc", "replace", "dev",
                        self.interface(island), "root", *qdisc], check=True, capture_output=True, text=True)

    def set_link(self, island: int, up: bool) -> None:
        """Take island `island`'s link down (its hub end: the island sees no carrier) or bring it back."""
        _ip("-n", self.hub, "link", "set", f"hub{island}", "up" if up else "down")

    def _shaper_counts(self, island: int) -> dict:
        """The kernel's counters of island `island`'s egress queue (`tc -s qdisc`)."""
        shown = subprocess.run(["ip", "netns", "exec", self.namespace(island), "tc", "-s", "-j", "qdisc", "show",
                                "dev", self.interface(island)], check=True, capture_output=True, text=True)
        return next(q for q in json.loads(shown.stdout) if q.get("root"))

    def kernel_bytes(self, island: int) -> tuple[int, int]:
        """(bytes, packets) the kernel's shaper has sent out of island `island` so far."""
        root = self._shaper_counts(island)
        return int(root["bytes"]), int(root["packets"])

    def tcp_losses(self, island: int) -> dict[str, int]:
        """Loss on island `island`'s link so far: packets its shaper dropped (its queue full), and
        its TCP's retransmitted segments and retransmission timeouts (the kernel's counters for the
        island's namespace, /proc/net/snmp and /proc/net/netstat)."""
        counters = subprocess.run(["ip", "netns", "exec", self.namespace(island), "cat", "/proc/net/snmp",
                                   "/proc/net/netstat"], check=True, capture_output=True, text=True).stdout
        lines = counters.splitlines()
        named = {}  # each table is a header line of names and a line of values, both led by "Tcp:" etc.
        for names, values in zip(lines[::2], lines[1::2]):
            prefix = names.split(":")[0]
            named.update({f"{prefix}.{n}": int(v) for n, v in zip(names.split()[1:], values.split()[1:])})
        return {"dropped": int(self._shaper_counts(island)["drops"]), "retransmitted": named["Tcp.RetransSegs"],
                "timeouts": named["TcpExt.TCPTimeouts"]}

    def payload_bytes(self, island: int) -> int:
        """What TCP carried out of the island: the kernel's bytes less every packet's headers
        (acknowledgements carry none)."""
        sent, packets = self.kernel_bytes(island)
        return sent - packets * PACKET_HEADER_BYTES

    def argv(self, island: int, command: list[str], env: dict[str, str] | None = None) -> list[str]:
        """`command` run inside island `island`'s namespace, gloo bound to its link."""
        settings = {"GLOO_SOCKET_IFNAME": self.interface(island), **(env or {})}
        return ["ip", "netns", "exec", self.namespace(island), "env",
                *(f"{key}={value}" for key, value in settings.items()), *command]


def _reap(tag: str) -> int:
    """The reaper: wait until the harness's pipe closes (it ended, whichever way), then remove
    what is left of its namespaces."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.buffer.read()
    remove_namespaces(owned_namespaces(tag))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Remove the real-link harness's namespaces: `reap TAG` waits for "
                                             "its stdin to close first; `clean` removes those of dead harnesses.")
    ap.add_argument("action", choices=("reap", "clean"))
    ap.add_argument("tag", nargs="?")
    args = ap.parse_args(argv)
    if args.action == "reap":
        return _reap(args.tag)
    for name in remove_leftovers():
        print(f"removed {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
