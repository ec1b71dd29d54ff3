"""A flood of advertisements cannot starve ``--discover``: joiners are tried concurrently (the
never-tried first), each address nobody answers at backs off on its own, at most
``MAX_TRACKED`` advertisements are tracked (the oldest never reached dropped first, said once a
minute), and addresses no other machine reaches a worker at (loopback, link-local) are refused
with a line.

The advertisements are offered to :class:`~hetconv.master.discovery.Discovery` directly (the
multicast side is tested in network namespaces in ``test_discovery.py``, as root); the worker
that must join through the flood is a real worker process.
"""

from __future__ import annotations

import contextlib
import io
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from hetconv.master import discovery
from hetconv.master.cluster import ACTIVE, READY, Cluster, ClusterConfig
from hetconv.master.discovery import Discovery, Joiners
from hetconv.master.launch import LocalWorkers
from hetconv.master.membership import Backoff
from hetconv.training import TrainConfig, train

TXT = {"version": "test", "backend": "cpu", "device": "test", "token": "none"}


def _lan(max_tracked: int = discovery.MAX_TRACKED) -> Discovery:
    return Discovery(has_token=False, max_tracked=max_tracked, browse=False)


# -- what is tracked ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ips, kind",
    [(["127.0.0.1"], "loopback"), (["169.254.10.2"], "link-local"), (["0.0.0.0"], "non-unicast")],
)
def test_an_address_no_other_machine_reaches_is_refused_with_a_line(ips, kind):
    lan = _lan()
    lan.offer("spoof._hetconv._tcp.local.", ips, 50051, TXT)
    assert lan.workers() == [] and lan.poll() == []
    (refusal,) = lan.take_refusals()
    assert refusal.address == f"{ips[0]}:50051"
    assert f"only {kind} addresses ({ips[0]})" in refusal.reason
    assert "--worker" in refusal.reason
    lan.offer("spoof._hetconv._tcp.local.", ips, 50051, TXT)  # said once
    assert lan.take_refusals() == []
    lan.close()


def test_loopback_beside_a_lan_address_is_left_out_silently():
    lan = _lan()
    lan.offer("w._hetconv._tcp.local.", ["127.0.0.1", "198.51.100.7"], 50051, TXT)
    (worker,) = lan.workers()
    assert worker.address == "198.51.100.7:50051" and worker.addresses == ("198.51.100.7",)
    assert lan.take_refusals() == []
    lan.close()


def test_a_worker_advertises_no_loopback_and_link_local_only_when_nothing_else():
    from hetconv.worker.advertise import InterfaceAddress, advertised_ips

    lo, ll = InterfaceAddress("127.0.0.1", "lo"), InterfaceAddress("169.254.3.4", "eth1")
    lan = InterfaceAddress("192.168.1.20", "wlan0")
    assert advertised_ips([lo, ll, lan]) == ["192.168.1.20"]
    assert advertised_ips([lo, ll]) == ["169.254.3.4"]  # a cable, no DHCP: the master says why
    assert advertised_ips([lo]) == []


def test_the_cap_drops_the_oldest_never_reached_and_says_so_once():
    lan = _lan(max_tracked=4)
    for i in range(4):
        lan.offer(f"w{i}._hetconv._tcp.local.", [f"198.51.100.{i + 1}"], 50051, TXT)
    assert lan.take_notices() == []
    lan.mark_reached("198.51.100.1:50051")  # w0, the oldest, answered
    for i in range(4, 7):
        lan.offer(f"w{i}._hetconv._tcp.local.", [f"198.51.100.{i + 1}"], 50051, TXT)
    tracked = {w.service.split(".")[0] for w in lan.workers()}
    assert tracked == {"w0", "w4", "w5", "w6"}  # w1..w3 never reached: dropped, oldest first
    (notice,) = lan.take_notices()  # one line, not one per advertisement
    assert notice.startswith("more than 4 workers advertised on the LAN: tracking 4, 1 ")
    assert "oldest never reached first" in notice
    for address in ("198.51.100.5", "198.51.100.6", "198.51.100.7"):
        lan.mark_reached(f"{address}:50051")
    lan.offer("late._hetconv._tcp.local.", ["198.51.100.99"], 50051, TXT)
    assert "late" not in {w.service.split(".")[0] for w in lan.workers()}  # all four answered
    lan.close()


def test_an_advertisement_not_announced_whole_is_resolved_off_the_browser_thread():
    """The browser thread hands out every advertisement in turn: one whose records must be
    asked for (3 s each when nobody answers) would hold up all the others."""
    from zeroconf import ServiceStateChange
    from zeroconf._cache import DNSCache

    asked = threading.Event()

    class Silent:  # a zeroconf with nothing in its cache, whose questions go unanswered
        cache = DNSCache()

        def get_service_info(self, service_type, name, timeout):
            asked.set()
            time.sleep(timeout / 1000)

    lan = _lan()
    began = time.monotonic()
    for i in range(20):
        name = f"fake{i}._hetconv._tcp.local."
        lan._on_change(Silent(), discovery.SERVICE_TYPE, name, ServiceStateChange.Added)
    assert time.monotonic() - began < 0.5
    assert asked.wait(5)
    # a pointer to a name of another type is ignored, not an exception in the browser's thread
    lan._on_change(
        Silent(), discovery.SERVICE_TYPE, "x._other._tcp.local.", ServiceStateChange.Added
    )
    lan.close()


# -- trying joiners ---------------------------------------------------------------------------


def test_joiners_are_tried_concurrently_the_never_tried_first():
    tried, lock = [], threading.Lock()

    def join(node):
        with lock:
            tried.append(node.name)

    def unreachable(node, error):
        with lock:
            tried.append(f"unreachable {node.name}")

    server = socket.create_server(("127.0.0.1", 0))
    real = f"127.0.0.1:{server.getsockname()[1]}"
    nodes = [
        SimpleNamespace(name=f"198.51.100.{i}:50051", backoff=Backoff(failures=1 + i % 3))
        for i in range(8)
    ]
    nodes.append(SimpleNamespace(name=real, backoff=Backoff()))
    joiners = Joiners(join, unreachable, bound=4, timeout=0.5)
    began = time.monotonic()
    joiners.submit(nodes)  # four of them (the bound): the rest wait for the next submit
    while joiners.busy():
        time.sleep(0.01)
    assert time.monotonic() - began < 2  # four at once, each on its own deadline
    assert real in tried  # the one never tried went first
    assert len(tried) == 4
    assert sum(t.startswith("unreachable") for t in tried) == 3  # then the fewest failures
    joiners.close()
    server.close()


def test_at_start_advertised_workers_nothing_answers_at_are_not_waited_for(capsys):
    from hetconv.cli.discover import _answering

    server = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    answering = f"127.0.0.1:{server.getsockname()[1]}"
    refusing = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    silent = [f"198.51.100.{i}:50051" for i in range(1, 21)]
    found = [
        discovery.FoundWorker(f"w{i}", address, (address.split(":")[0],), TXT)
        for i, address in enumerate([*silent, refusing, answering])
    ]
    began = time.monotonic()
    assert _answering(found) == found[-1:]
    assert time.monotonic() - began < 3.5  # 21 addresses, 16 at once, a second each at most
    out = capsys.readouterr().out
    assert out.startswith("found 21 more advertised workers that nothing answers at yet (")
    assert "tried while training" in out
    server.close()


# -- a real worker joining through a flood --------------------------------------------------


class Flooded(Cluster):
    """A cluster that runs ``actions[step]`` just before that step begins."""

    def __init__(self, actions, **config):
        super().__init__([], config=ClusterConfig(retry_min=0.5, retry_max=4.0, **config))
        self.actions = actions

    def begin_step(self, step):
        action = self.actions.get(step)
        if action:
            action(self)
        super().begin_step(step)


@contextlib.contextmanager
def tarpits(count: int):
    """``count`` addresses that accept TCP connections and never answer (a backlog nobody
    reads): a gRPC connection to one waits for its deadline."""
    servers = [socket.create_server(("127.0.0.1", 0), backlog=64) for _ in range(count)]
    try:
        yield [f"127.0.0.1:{s.getsockname()[1]}" for s in servers]
    finally:
        for s in servers:
            s.close()


@pytest.mark.slow
def test_a_worker_advertised_in_a_flood_joins_at_the_next_step_boundary(tmp_path, monkeypatch):
    """100 advertisements: 40 at addresses that accept and never answer, 60 at TEST-NET
    addresses nobody answers at; then a real worker. Tried one by one (2 s each) it waited
    minutes; it is ready within seconds and joins at the next step boundary."""
    monkeypatch.setattr(discovery, "refused_kind", lambda ip: None)  # loopback plays the LAN
    lan = _lan()
    waited = {}
    with LocalWorkers(1) as workers, tarpits(40) as silent:
        (real,) = workers.addresses
        flood = silent + [f"198.51.100.{i}:{50000 + i}" for i in range(60)]

        def advertise_flood(cluster):
            for i, address in enumerate(flood):
                host, port = address.rsplit(":", 1)
                lan.offer(f"fake{i}._hetconv._tcp.local.", [host], int(port), TXT)
            time.sleep(1.5)  # the first tries under way

        def advertise_real(cluster):
            host, port = real.rsplit(":", 1)
            lan.offer("real._hetconv._tcp.local.", [host], int(port), TXT)
            began = time.monotonic()
            while not any(n.name == real and n.state in (READY, ACTIVE) for n in _all(cluster)):
                assert time.monotonic() - began < 20, "the real worker was starved by the flood"
                time.sleep(0.05)
            waited["seconds"] = time.monotonic() - began

        with Flooded({2: advertise_flood, 3: advertise_real}) as cluster:
            cluster.membership.follow(lan, [])
            config = TrainConfig(steps=5, batch=8, train_size=40, eval_size=0, progress=False)
            train(config, cluster, log=io.StringIO())
            events = [(e["event"], e.get("worker"), e["step"]) for e in cluster.events]
            dropped = [e for e in cluster.events if e["event"] == "advertisements_dropped"]
            unreachable = [e for e in cluster.events if e["event"] == "worker_unreachable"]
            unanswered = [
                e for e in cluster.events if e["event"] == "advertised_workers_unanswered"
            ]
    lan.close()
    assert ("worker_joined", real, 3) in events
    assert waited["seconds"] < 10
    assert len(dropped) == 1 and "tracking 64" in dropped[0]["reason"]
    # the flood was tried and backed off, said in one line, not one per address
    assert unreachable == [] and len(unanswered) == 1
    assert unanswered[0]["count"] >= 16 and unanswered[0]["reason"].split(" ")[0] in flood
    assert not any(kind == "worker_joined" and who != real for kind, who, _ in events)


def _all(cluster):
    with cluster.membership.lock:
        return list(cluster.nodes + cluster._pending)


# -- a flood on a LAN of network namespaces -------------------------------------------------

#: Sends ``count`` advertisements of hetconv workers at unused addresses of a /24 (argv: this
#: namespace's address, the network's first three octets, count), 20 services a packet, every
#: 20 s, plus one naming 127.0.0.1: a flood anyone on the LAN can send.
FLOOD = """
import socket, sys, time
from zeroconf import DNSOutgoing, ServiceInfo, const
own, net, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
infos = [ServiceInfo("_hetconv._tcp.local.", f"fake {i}._hetconv._tcp.local.",
                     addresses=[socket.inet_aton(f"{net}.{100 + i % 150}")], port=40000 + i,
                     properties={"token": "none", "backend": "cpu"}, server=f"fake-{i}.local.")
         for i in range(count)]
infos.append(ServiceInfo("_hetconv._tcp.local.", "spoof._hetconv._tcp.local.",
                         addresses=[socket.inet_aton("127.0.0.1")], port=50051,
                         properties={"token": "none"}, server="spoof.local."))
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("", 5353))
sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(own))
sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
while True:
    for start in range(0, len(infos), 20):
        out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
        for info in infos[start:start + 20]:
            for record in (info.dns_pointer(), info.dns_service(), info.dns_text(),
                           *info.dns_addresses()):
                out.add_answer_at_time(record, 0)
        for packet in out.packets():
            sock.sendto(packet, ("224.0.0.251", 5353))
    print("flooded", flush=True)
    time.sleep(20)
"""


@pytest.mark.slow
def test_a_flood_of_advertisements_on_the_lan_does_not_starve_discover(tmp_path):
    """200 advertisements at unused addresses (and one naming 127.0.0.1) from a namespace on
    the LAN; a real worker started once training runs joins within seconds, the spoof is
    refused with a line, and one line says advertisements were dropped."""
    import subprocess
    import sys

    from test_discovery import WORKER_QUIET, Lan, Proc, _unavailable

    why = _unavailable()
    if why:
        pytest.skip(why)
    try:
        lan = Lan(["m", "w1", "f"]).__enter__()
    except (RuntimeError, subprocess.CalledProcessError) as e:
        pytest.skip(f"network namespaces with a bridge are unavailable here: {e}")
    try:
        net = lan.ips["f"].rsplit(".", 1)[0]
        command = ["ip", "netns", "exec", lan.namespaces["f"], sys.executable, "-c", FLOOD]
        flood = subprocess.Popen(
            [*command, lan.ips["f"], net, "200"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        lan.processes.append(flood)
        Proc(flood).wait_for("flooded", 30)
        master = lan.start(
            "m",
            "train", "--discover", "--discover-wait", "2", "--preset", "tiny", "--batch", "8",
            "--steps", "100000", "--no-progress", "--eval-size", "0", "--shares", "compute",
            "--rebalance-every", "0",
        )  # fmt: skip
        master.wait_for("training tiny", 120)
        refused = master.wait_for("worker refused 127.0.0.1", 60)  # the flood comes every 20 s
        assert "only loopback addresses" in refused and "--worker" in refused
        master.wait_for("advertisements dropped", 10)
        master.wait_for("advertised workers unanswered", 10)
        worker = lan.start("w1", *WORKER_QUIET)
        worker.wait_for("hetconv worker ready on", 60)
        began = time.monotonic()
        joined = master.wait_for("worker joined", 60)
        assert f"{lan.ips['w1']}:50051" in joined
        assert time.monotonic() - began < 30
        assert not any("worker unreachable" in line for line in master.lines)
        assert master.stop(signal.SIGINT, timeout=60) == 130
        assert worker.stop() == 0
    finally:
        lan.close()
