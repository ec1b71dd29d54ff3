"""Workers found on the LAN: browse DNS-SD/mDNS for advertised ``hetconv worker`` processes.

``hetconv train --discover`` browses the service type workers register (``_hetconv._tcp``,
see ``hetconv.worker.advertise``; the two ends share only the name and the TXT keys) and
keeps browsing while training: the membership's monitor thread polls :meth:`Discovery.poll`
and treats what it returns like the lines of a workers file (workers that appear join at a
step boundary after their probe; workers that unregister leave at one).

A worker's advertisement carries no secret, only whether it requires a token: one that does,
found by a master without a token, is reported once (``worker_refused``) and never called.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from dataclasses import dataclass

#: The DNS-SD service type hetconv workers register (the worker's advertise module's).
SERVICE_TYPE = "_hetconv._tcp.local."


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
    """

    def __init__(self, has_token: bool):
        from zeroconf import IPVersion, ServiceBrowser, Zeroconf

        self._has_token = has_token
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._found: dict[str, FoundWorker] = {}  # service name -> worker
        self._refusals: list[Refusal] = []  # not handed out yet
        self._refused: set[str] = set()  # service names refused (reported once)
        self._version = 0  # bumped at every change of _found
        self._polled = -1
        self._networks = _local_networks()
        self._zeroconf = Zeroconf(ip_version=IPVersion.V4Only)
        self._browser = ServiceBrowser(self._zeroconf, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        """zeroconf's browser thread: a service was added, updated or removed."""
        from zeroconf import IPVersion, ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            with self._changed:
                if self._found.pop(name, None) is not None:
                    self._version += 1
                    self._changed.notify_all()
                self._refused.discard(name)  # it may come back with another configuration
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is None or not info.port:
            return
        ips = info.parsed_addresses(IPVersion.V4Only)
        ip = choose_address(ips, self._networks)
        if ip is None:
            return
        properties = {
            k.decode("utf-8", "replace"): (v or b"").decode("utf-8", "replace")
            for k, v in info.properties.items()
        }
        worker = FoundWorker(name, f"{ip}:{info.port}", tuple(ips), properties)
        with self._changed:
            if worker.token_required and not self._has_token:
                if name not in self._refused:
                    self._refused.add(name)
                    self._refusals.append(
                        Refusal(
                            worker.address,
                            "it requires a token and this master has none: give the "
                            "worker's with --token or $HETCONV_TOKEN",
                        )
                    )
                    self._changed.notify_all()
                return
            if self._found.get(name) != worker:
                self._found[name] = worker
                self._version += 1
                self._changed.notify_all()

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

    def poll(self) -> list[str] | None:
        """The usable addresses if they changed since the last poll, else None."""
        with self._lock:
            if self._version == self._polled:
                return None
            self._polled = self._version
        return self.addresses()

    def close(self) -> None:
        """Stop browsing."""
        self._browser.cancel()
        self._zeroconf.close()
