"""A worker on the LAN: the addresses a master should type, and a DNS-SD/mDNS advertisement.

A worker listening beyond loopback registers one service of type :data:`SERVICE_TYPE` (the
``zeroconf`` library: multicast DNS, Bonjour/Avahi compatible) with every non-loopback IPv4
address of the machine it listens on (all of them for ``0.0.0.0``), so that
``hetconv train --discover`` finds it. Its TXT record says what a master needs to decide
before calling it: the hetconv version, the backend, the device, whether a token is required
(never the token) and the worker process's instance id (Describe's, so a master can tell two
addresses of one worker apart). The service is unregistered when the worker stops.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from hetconv import __version__

#: The DNS-SD service type every hetconv worker registers.
SERVICE_TYPE = "_hetconv._tcp.local."


@dataclass(frozen=True)
class InterfaceAddress:
    """One IPv4 address of this machine and the interface (adapter) that holds it."""

    ip: str
    interface: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip).is_loopback

    @property
    def link_local(self) -> bool:
        return ipaddress.ip_address(self.ip).is_link_local


def interface_addresses() -> list[InterfaceAddress]:
    """Every IPv4 address of this machine's interfaces, loopback included (``ifaddr``: Linux,
    macOS and Windows alike; without it, what the host name resolves to)."""
    try:
        import ifaddr
    except ImportError:  # zeroconf's dependency: missing only in a broken install
        try:
            ips = socket.gethostbyname_ex(socket.gethostname())[2]
        except OSError:
            ips = []
        return [InterfaceAddress(ip, "") for ip in dict.fromkeys(["127.0.0.1", *ips])]

    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):  # IPv6 addresses come as tuples
                found.append(InterfaceAddress(ip.ip, adapter.nice_name))
    return found


def reachable_addresses(
    host: str, available: list[InterfaceAddress] | None = None
) -> list[InterfaceAddress]:
    """The addresses a master can reach a worker listening on ``host`` at: every interface's
    for a wildcard host (``0.0.0.0``, ``::``, empty), else the one ``host`` names (resolved
    when a name). Loopback ones included (:attr:`InterfaceAddress.loopback` tells them)."""
    available = interface_addresses() if available is None else available
    if host in ("0.0.0.0", "::", "[::]", ""):
        return available
    try:
        ip = socket.gethostbyname(host.strip("[]"))
    except OSError:
        return []
    named = [a for a in available if a.ip == ip]
    return named or [InterfaceAddress(ip, "")]


def addresses_line(host: str, port: int, addresses: list[InterfaceAddress]) -> str:
    """The line a worker prints so its user knows what to type on the master:
    ``masters use: 192.168.1.20:50051 (wlan0), 127.0.0.1:50051 (lo, this machine only)``."""
    if not addresses:
        return f"masters use: {host}:{port}"
    parts = []
    for a in sorted(addresses, key=lambda a: a.loopback):  # the ones to type first
        where = a.interface
        if a.loopback:
            where = f"{where}, this machine only" if where else "this machine only"
        parts.append(f"{a.ip}:{port} ({where})" if where else f"{a.ip}:{port}")
    return "masters use: " + ", ".join(parts)


def txt_properties(
    backend: str, device: str, token_required: bool, instance_id: int
) -> dict[str, str]:
    """The TXT record of a worker's advertisement (no secret in it: only whether one is
    required)."""
    return {
        "version": __version__,
        "backend": backend,
        "device": device[:200],  # a TXT string holds at most 255 bytes
        "token": "required" if token_required else "none",
        "instance": f"{instance_id:016x}",
    }


def advertised_ips(addresses: list[InterfaceAddress]) -> list[str]:
    """The IPv4 addresses a worker advertises: none loopback, and none link-local when another
    remains (masters take neither from the LAN: a link-local-only worker is advertised, and a
    master says why it does not call it)."""
    beyond = sorted({a.ip for a in addresses if not a.loopback})
    routable = sorted({a.ip for a in addresses if not a.loopback and not a.link_local})
    return routable or beyond


class Advertisement:
    """A worker registered under :data:`SERVICE_TYPE` on its non-loopback addresses until
    :meth:`close`.

    Args:
        port: the port it serves on.
        addresses: the IPv4 addresses to advertise (loopback ones are left out, and link-local
            ones when another remains: masters take neither from the LAN).
        properties: its TXT record (:func:`txt_properties`).
        instance_id: its worker process's id: the service and host names carry it, so workers
            on machines (or network namespaces) with one host name do not collide.

    Raises:
        ValueError: no non-loopback address to advertise.
        OSError: multicast DNS could not be started (no multicast route, a port taken).
    """

    def __init__(
        self,
        port: int,
        addresses: list[InterfaceAddress],
        properties: dict[str, str],
        instance_id: int,
    ):
        from zeroconf import IPVersion, ServiceInfo, Zeroconf

        ips = advertised_ips(addresses)
        if not ips:
            raise ValueError("no address beyond loopback to advertise")
        self.addresses = ips
        host = socket.gethostname().split(".")[0] or "worker"
        label = f"hetconv {host} {instance_id:016x}"[:63]  # one DNS label: at most 63 bytes
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{label}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(ip) for ip in ips],
            port=port,
            properties=properties,
            server=f"hetconv-{instance_id:016x}.local.",
        )
        self._zeroconf = Zeroconf(interfaces=ips, ip_version=IPVersion.V4Only)
        try:
            self._zeroconf.register_service(self.info, allow_name_change=True)
        except BaseException:
            self._zeroconf.close()
            raise
        self._closed = False

    @property
    def name(self) -> str:
        """The service instance name as registered."""
        return self.info.name

    def close(self) -> None:
        """Unregister (masters browsing see the worker go) and stop multicast DNS."""
        if self._closed:
            return
        self._closed = True
        try:
            self._zeroconf.unregister_service(self.info)
        finally:
            self._zeroconf.close()
