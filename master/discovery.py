"""Workers found on the LAN: browse DNS-SD/mDNS for advertised ``hetconv worker`` processes.

``hetconv train --discover`` browses the service type workers register (``_hetconv._tcp``,
see ``hetconv.worker.advertise``; the two ends share only the name and the TXT keys) and
keeps browsing while training: the membership's monitor thread polls :meth:`Discovery.poll`
and treats what it returns like the lines of a workers file (workers that appear join at a
step boundary after their probe; workers that unregister leave at one).

A worker's advertisement carries no secret, only whether it requires a token: one that does,
found by a master without a token, is reported once (``worker_refused``) and never called.

Anyone on the LAN can advertise, so nothing one sends may starve the workers that answer: an
advertisement whose records were not announced is resolved off the browser's thread (a few at
a time), at most :data:`MAX_TRACKED` advertised workers are tracked (a newcomer displaces the
oldest never reached, never one that answered; ``advertisements_dropped`` says so), addresses
no other machine reaches a worker at (loopback, link-local) are refused with a line, and the
joiners are tried concurrently (:class:`Joiners`), the never-tried first, each address backed
off on its own.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: The DNS-SD service type hetconv workers register (the worker's advertise module's).
SERVICE_TYPE = "_hetconv._tcp.local."
#: Advertised workers tracked at once (a LAN with more hetconv workers names them instead).
MAX_TRACKED = 64
#: Advertisements resolved at once (their SRV, TXT and address records asked for when they
#: were not announced with the name), and the longest each may take, milliseconds.
RESOLVERS, RESOLVE_MS = 4, 3000
#: Joiners found on the LAN tried at once, and the seconds a TCP connection to one may take.
JOIN_BOUND, REACH_TIMEOUT = 16, 1.0
#: Seconds between two lines saying that advertisements were dropped.
NOTICE_EVERY = 60.0


@dataclass(frozen=True)
class FoundWorker:
    """One advertised worker: the address chosen to reach it and what its TXT record says."""

    service: str  # the DNS-SD instance name
    address: str  # HOST:PORT
    addresses: tuple[str, ...]  # every IPv4 address it advertised
    properties: dict[str, str]

    @property
    def token_required(self) -> bool:
        return self.properties.get("token") == "required"

    def describe(self) -> str:
        p = self.properties
        device = p.get("device", "unknown device")
        return f"{self.address} ({device}, {p.get('backend', '?')} backend)"


@dataclass(frozen=True)
class Refusal:
    """An advertised worker the master will not call, and why."""

    address: str
    reason: str


def _local_networks() -> list[ipaddress.IPv4Network]:
    import ifaddr

    networks = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                networks.append(ipaddress.ip_network(f"{ip.ip}/{ip.network_prefix}", strict=False))
    return networks


def refused_kind(ip: str) -> str | None:
    """Why an advertised address is no way to reach a worker from another machine
    (``"loopback"``, ``"link-local"``, ``"non-unicast"``), or None for one to use."""
    address = ipaddress.ip_address(ip)
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_unspecified or address.is_multicast or address.is_reserved:
        return "non-unicast"
    return None


def choose_address(ips: list[str], networks: list[ipaddress.IPv4Network]) -> str | None:
    """Of a worker's advertised IPv4 addresses, the first on a network this machine is on
    (directly reachable), else the first; None for none."""
    for ip in ips:
        if any(ipaddress.ip_address(ip) in net for net in networks if net.prefixlen > 0):
            return ip
    return ips[0] if ips else None


class Discovery:
    """Browse the LAN for hetconv workers until :meth:`close`.

    Args:
        has_token: whether this master carries a token; workers advertising that they need
            one are refused without it.
        max_tracked: advertised workers tracked at once (:data:`MAX_TRACKED`).
        browse: start browsing (False: only :meth:`offer` adds workers; tests).
    """

    def __init__(self, has_token: bool, max_tracked: int = MAX_TRACKED, browse: bool = True):
        self._has_token = has_token
        self._max_tracked = max_tracked
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._found: dict[str, FoundWorker] = {}  # service name -> worker, oldest first
        self._reached: set[str] = set()  # addresses a master reached: never displaced
        self._refusals: list[Refusal] = []  # not handed out yet
        self._refused: set[str] = set()  # service names refused (reported once)
        self._notices: list[str] = []  # not handed out yet
        self._dropped = 0  # advertisements dropped so far
        self._noticed_at = -NOTICE_EVERY  # time.monotonic() of the last notice
        self._resolving: set[str] = set()  # service names being resolved
        self._version = 0  # bumped at every change of _found
        self._polled = -1
        self._networks = _local_networks()
        self._resolver = ThreadPoolExecutor(RESOLVERS, thread_name_prefix="hetconv-resolve")
        self._zeroconf = self._browser = None
        if browse:
            from zeroconf import IPVersion, ServiceBrowser, Zeroconf

            self._zeroconf = Zeroconf(ip_version=IPVersion.V4Only)
            self._browser = ServiceBrowser(self._zeroconf, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        """zeroconf's browser thread: a service was added, updated or removed. Never waits on
        the network: one whose records are not at hand is resolved by the resolver pool."""
        from zeroconf import ServiceInfo, ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            with self._changed:
                if self._found.pop(name, None) is not None:
                    self._version += 1
                    self._changed.notify_all()
                self._refused.discard(name)  # it may come back with another configuration
            return
        try:
            info = ServiceInfo(service_type, name)
        except Exception:  # a name not of the type (a forged pointer): nothing to resolve
            return
        if info.load_from_cache(zeroconf):
            self._resolved(name, info)
            return
        with self._lock:
            if name in self._resolving or len(self._resolving) >= self._max_tracked:
                return  # asked already, or a flood of names: asked again when announced again
            self._resolving.add(name)
        self._resolver.submit(self._resolve, zeroconf, service_type, name)

    def _resolve(self, zeroconf, service_type: str, name: str) -> None:
        """A resolver thread: ask for the records of an advertisement not announced whole."""
        try:
            info = zeroconf.get_service_info(service_type, name, timeout=RESOLVE_MS)
        except Exception:  # zeroconf closed under it: the master is stopping
            info = None
        finally:
            with self._lock:
                self._resolving.discard(name)
        if info is not None:
            self._resolved(name, info)

    def _resolved(self, name: str, info) -> None:
        from zeroconf import IPVersion

        if not info.port:
            return
        properties = {
            k.decode("utf-8", "replace"): (v or b"").decode("utf-8", "replace")
            for k, v in info.properties.items()
        }
        self.offer(name, info.parsed_addresses(IPVersion.V4Only), info.port, properties)

    def offer(self, name: str, ips: list[str], port: int, properties: dict[str, str]) -> None:
        """An advertisement (service ``name``, its IPv4 addresses, port and TXT record):
        tracked, refused with a reason, or dropped when :data:`MAX_TRACKED` are tracked and
        none can be displaced."""
        usable = [ip for ip in ips if refused_kind(ip) is None]
        if not usable:
            if ips:
                kinds = " or ".join(dict.fromkeys(refused_kind(ip) for ip in ips))
                self._refuse(
                    name,
                    f"{ips[0]}:{port}",
                    f"it advertises only {kinds} addresses ({', '.join(ips)}), which masters do "
                    "not take from the LAN: name the worker with --worker (one on this machine "
                    "as 127.0.0.1:PORT)",
                )
            return
        ip = choose_address(usable, self._networks)
        worker = FoundWorker(name, f"{ip}:{port}", tuple(usable), properties)
        if worker.token_required and not self._has_token:
            self._refuse(
                name,
                worker.address,
                "it requires a token and this master has none: give the worker's with "
                "--token or $HETCONV_TOKEN",
            )
            return
        with self._changed:
            if self._found.get(name) == worker:
                return
            if name not in self._found and not self._make_room():
                return
            self._found[name] = worker
            self._version += 1
            self._changed.notify_all()

    def _refuse(self, name: str, address: str, reason: str) -> None:
        with self._changed:
            if name not in self._refused:
                self._refused.add(name)
                self._refusals.append(Refusal(address, reason))
                self._changed.notify_all()

    def _make_room(self) -> bool:
        """Under the lock, a newcomer to track: whether there is room, displacing the oldest
        advertised worker never reached when all are taken (one that answered stays, and the
        newcomer is dropped when every tracked one answered)."""
        if len(self._found) < self._max_tracked:
            return True
        never_reached = [n for n, w in self._found.items() if w.address not in self._reached]
        if never_reached:
            del self._found[never_reached[0]]
        self._dropped += 1
        now = time.monotonic()
        if now - self._noticed_at >= NOTICE_EVERY:
            self._noticed_at = now
            self._notices.append(
                f"more than {self._max_tracked} workers advertised on the LAN: tracking "
                f"{self._max_tracked}, {self._dropped} advertisement"
                f"{'s' if self._dropped != 1 else ''} dropped so far (the oldest never reached "
                "first; workers that answered are kept); if these are not yours, someone floods "
                "the LAN: name your workers with --worker"
            )
        return bool(never_reached)

    def mark_reached(self, address: str) -> None:
        """The master reached the worker at ``address``: never displaced by newcomers."""
        with self._lock:
            self._reached.add(address)

    def workers(self) -> list[FoundWorker]:
        """The workers advertised now (usable by this master), by address."""
        with self._lock:
            return sorted(self._found.values(), key=lambda w: w.address)

    def addresses(self) -> list[str]:
        """``HOST:PORT`` of every usable worker advertised now, each once."""
        return list(dict.fromkeys(w.address for w in self.workers()))

    def wait(self, seconds: float) -> list[FoundWorker]:
        """Browse for ``seconds`` (answers to the first query come within about a second,
        later ones as workers start); the workers found."""
        end = time.monotonic() + seconds
        with self._changed:
            while (left := end - time.monotonic()) > 0:
                self._changed.wait(left)
        return self.workers()

    def take_refusals(self) -> list[Refusal]:
        """Workers refused since the last call (each reported once)."""
        with self._lock:
            refusals, self._refusals = self._refusals, []
        return refusals

    def take_notices(self) -> list[str]:
        """Lines saying that advertisements were dropped (at most one a minute)."""
        with self._lock:
            notices, self._notices = self._notices, []
        return notices

    def poll(self) -> list[str] | None:
        """The usable addresses if they changed since the last poll, else None."""
        with self._lock:
            if self._version == self._polled:
                return None
            self._polled = self._version
        return self.addresses()

    def close(self) -> None:
        """Stop browsing."""
        if self._browser is not None:
            self._browser.cancel()
            self._zeroconf.close()
        self._resolver.shutdown(wait=False, cancel_futures=True)


def reach(address: str, timeout: float = REACH_TIMEOUT) -> OSError | None:
    """Whether a TCP connection to ``HOST:PORT`` opens in ``timeout`` seconds: None, or why
    not (an address nobody answers at costs the caller ``timeout``, not a gRPC deadline)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        return OSError(f"nothing answers at {address} in {timeout:g} s ({why})")


class Joiners:
    """Workers found on the LAN tried concurrently, at most ``bound`` at once, each first with a
    TCP connection (:func:`reach`) and, if one opens, with ``join`` (connect, describe, probe).

    Of the joiners due, the ones tried fewest times go first, the newest among them first: a
    worker that appears is tried within about ``timeout`` however many advertised addresses
    never answer (those back off, each on its own, through ``unreachable``).

    Args:
        join: tries a node; handles its own failures.
        unreachable: ``(node, error)`` for a node no TCP connection reached.
    """

    def __init__(
        self,
        join: Callable[[object], None],
        unreachable: Callable[[object, Exception], None],
        bound: int = JOIN_BOUND,
        timeout: float = REACH_TIMEOUT,
    ):
        self._join, self._unreachable = join, unreachable
        self._bound, self._timeout = bound, timeout
        self._busy: set[str] = set()  # names being tried
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(bound, thread_name_prefix="hetconv-join")

    def submit(self, due: list) -> None:
        """Try as many of ``due`` (nodes with ``name`` and ``backoff``, oldest first) as there
        are free slots; the others wait for the next call."""
        with self._lock:
            waiting = [(i, n) for i, n in enumerate(due) if n.name not in self._busy]
            waiting.sort(key=lambda item: (item[1].backoff.failures, -item[0]))
            chosen = [n for _, n in waiting[: max(self._bound - len(self._busy), 0)]]
            self._busy.update(n.name for n in chosen)
        for node in chosen:
            self._pool.submit(self._try, node)

    def busy(self) -> int:
        """Joiners being tried now."""
        with self._lock:
            return len(self._busy)

    def _try(self, node) -> None:
        try:
            error = reach(node.name, self._timeout)
            if error is None:
                self._join(node)
            else:
                self._unreachable(node, error)
        finally:
            with self._lock:
                self._busy.discard(node.name)

    def close(self) -> None:
        """Try no more (a try under way ends on its own deadline)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
