"""Workers found on the LAN: real ``hetconv worker`` processes advertising by DNS-SD/mDNS in
network namespaces joined by a bridge (multicast flooded), and a real master with
``--discover`` in another namespace finding, admitting and retiring them."""

from __future__ import annotations

import collections
import ipaddress
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetconv.master import discovery
from hetconv.worker import advertise

HETCONV = str(Path(sys.executable).with_name("hetconv"))


def test_master_and_worker_agree_on_the_service_type():
    # master/ and worker/ never import each other: each spells the type once.
    assert discovery.SERVICE_TYPE == advertise.SERVICE_TYPE == "_hetconv._tcp.local."


def test_txt_record_says_whether_a_token_is_required_never_the_token():
    txt = advertise.txt_properties("cpu", "AMD EPYC", True, 0xABC)
    assert txt == {
        "version": txt["version"],
        "backend": "cpu",
        "device": "AMD EPYC",
        "token": "required",
        "instance": "0000000000000abc",
    }
    assert advertise.txt_properties("cuda", "H100", False, 1)["token"] == "none"


def test_addresses_line_lists_the_lan_first_and_marks_loopback():
    found = [
        advertise.InterfaceAddress("127.0.0.1", "lo"),
        advertise.InterfaceAddress("192.168.1.20", "wlan0"),
    ]
    assert advertise.reachable_addresses("0.0.0.0", found) == found
    assert advertise.reachable_addresses("192.168.1.20", found) == found[1:]
    line = advertise.addresses_line("0.0.0.0", 50051, found)
    assert (
        line == "masters use: 192.168.1.20:50051 (wlan0), 127.0.0.1:50051 (lo, this machine only)"
    )


def test_a_master_picks_the_address_on_its_own_network():
    nets = [ipaddress.ip_network("10.1.0.0/24"), ipaddress.ip_network("0.0.0.0/0")]
    assert discovery.choose_address(["172.17.0.2", "10.1.0.7"], nets) == "10.1.0.7"
    assert discovery.choose_address(["172.17.0.2"], nets) == "172.17.0.2"
    assert discovery.choose_address([], nets) is None


# -- a LAN of network namespaces ----------------------------------------------------------------


def _unavailable() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and a bridge)"
    if shutil.which("ip") is None:
        return "needs the 'ip' command (iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class Lan:
    """Namespaces joined by one bridge (in a namespace of its own) on 10.77.N.0/24, multicast
    on and snooping off, so mDNS reaches every member as on a home LAN."""

    def __init__(self, members: list[str]):
        tag = f"hcvl{os.getpid() % 10**6}"
        self.bridge_ns = f"{tag}b"
        self.namespaces = {m: f"{tag}{m}" for m in members}
        self.ips = {m: f"10.77.{os.getpid() % 200 + 1}.{i + 1}" for i, m in enumerate(members)}
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> Lan:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        br = ("ip", "netns", "exec", self.bridge_ns)
        subprocess.run([*br, "ip", "link", "add", "br0", "type", "bridge"], check=True)
        # Snooping off: multicast is flooded to every port (no IGMP querier on this LAN).
        subprocess.run(
            [*br, "ip", "link", "set", "br0", "type", "bridge", "mcast_snooping", "0"], check=True
        )
        subprocess.run([*br, "ip", "link", "set", "br0", "up"], check=True)
        for member, ns in self.namespaces.items():
            _ip("netns", "add", ns)
            outer, inner = f"{ns}o", f"{ns}i"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "netns", self.bridge_ns)
            _ip("link", "set", inner, "netns", ns)
            subprocess.run([*br, "ip", "link", "set", outer, "master", "br0", "up"], check=True)
            inside = ("ip", "netns", "exec", ns, "ip")
            subprocess.run([*inside, "link", "set", "lo", "up"], check=True)
            subprocess.run([*inside, "link", "set", inner, "name", "eth0"], check=True)
            address = f"{self.ips[member]}/24"
            subprocess.run([*inside, "addr", "add", address, "dev", "eth0"], check=True)
            subprocess.run([*inside, "link", "set", "eth0", "multicast", "on", "up"], check=True)

    def start(self, member: str, *args: str, env: dict | None = None) -> Proc:
        command = ["ip", "netns", "exec", self.namespaces[member], HETCONV, *args]
        environment = dict(os.environ, PYTHONUNBUFFERED="1")
        environment.pop("HETCONV_TOKEN", None)  # only the token a test gives
        environment.update(env or {})
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=environment,
        )
        self.processes.append(process)
        return Proc(process)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        for ns in [*self.namespaces.values(), self.bridge_ns]:
            _ip("netns", "del", ns, check=False)  # takes its veth ends along


class Proc:
    """A process whose output lines are read in the background and can be waited for."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.lines: collections.deque[str] = collections.deque(maxlen=2000)
        self._new: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            self._new.put(line.rstrip("\n"))
        self._new.put("")  # end of output

    def wait_for(self, text: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self._new.get(timeout=left)
            except queue.Empty:
                break
            if text in line:
                return line
            if line == "" and self.process.poll() is not None:
                break
        tail = "\n".join(self.lines)
        raise AssertionError(f"no line with {text!r} in {timeout} s; output:\n{tail}")

    def skip(self) -> None:
        """Forget the lines printed so far: the next wait_for sees only later ones."""
        while True:
            try:
                self._new.get_nowait()
            except queue.Empty:
                return

    def stop(self, signum=signal.SIGTERM, timeout: float = 30) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout)


WORKER = ("worker", "--listen", "0.0.0.0:50051", "--backend", "cpu", "--threads", "1")
WORKER_QUIET = (*WORKER, "--no-startup-probe", "--report-every", "2")


@pytest.fixture
def lan():
    why = _unavailable()
    if why:
        pytest.skip(why)
    try:
        with Lan(["m", "w1", "w2"]) as built:
            yield built
    except (RuntimeError, subprocess.CalledProcessError) as e:  # no bridge or netns support
        pytest.skip(f"network namespaces with a bridge are unavailable here: {e}")


@pytest.mark.slow
def test_master_finds_an_advertised_worker_and_trains_with_it(lan, tmp_path):
    """The fast variant: found at start, given kernels, served steps, the run ends cleanly."""
    w1 = lan.start("w1", *WORKER_QUIET)
    w1.wait_for("hetconv worker ready on", 60)
    trace = tmp_path / "trace.jsonl"
    master = lan.start(
        "m",
        "train", "--discover", "--discover-wait", "2", "--preset", "tiny", "--batch", "8",
        "--steps", "3", "--no-progress", "--eval-size", "0", "--shares", "compute",
        "--trace", str(trace),
    )  # fmt: skip
    address = f"{lan.ips['w1']}:50051"
    assert address in master.wait_for("found 1 worker", 60)
    assert master.process.wait(120) == 0, "\n".join(master.lines)
    plan = json.loads(trace.read_text().splitlines()[0])
    assert address in json.dumps(plan)
    w1.wait_for("served", 10)
    assert w1.stop() == 0
    assert w1.wait_for("stopped after", 10)


OURS, THEIRS = "our-shared-secret-of-enough-length", "their-shared-secret-of-enough-length"


@pytest.mark.slow
@pytest.mark.parametrize(
    "token, locked_token, why",
    [(None, THEIRS, "requires a token"), (OURS, THEIRS, "refused the token")],
    ids=["master-without-token", "master-with-another-token"],
)
def test_discovered_workers_join_and_leave_a_running_training(
    lan, tmp_path, token, locked_token, why
):
    """Worker 1 advertises; the master finds it at start and trains with it; worker 2 starts
    mid-run and is admitted at a step boundary; a worker whose token the master lacks (by
    its advertisement) or does not have (it refuses the master's) appears and is reported,
    never used; worker 1 stops (unregisters) and leaves."""
    ours = {"HETCONV_TOKEN": token} if token else None
    w1 = lan.start("w1", *WORKER_QUIET, env=ours)
    w1.wait_for("advertised on the LAN", 60)
    w1.wait_for("hetconv worker ready on", 10)
    trace = tmp_path / "trace.jsonl"
    master = lan.start(
        "m",
        "train", "--discover", "--discover-wait", "3", "--preset", "tiny", "--batch", "8",
        "--steps", "100000", "--no-progress", "--eval-size", "0", "--shares", "compute",
        "--rebalance-every", "0", "--trace", str(trace), env=ours,
    )  # fmt: skip
    first = f"{lan.ips['w1']}:50051"
    second = f"{lan.ips['w2']}:50051"
    found = master.wait_for("found 1 worker", 60)
    assert first in found
    master.wait_for("training tiny", 120)
    w2 = lan.start("w2", *WORKER_QUIET, env=ours)
    joined = master.wait_for("worker joined", 120)
    assert second in joined
    # one that needs a token this master lacks is reported once, never used
    locked = lan.start(
        "w2", "worker", "--listen", "0.0.0.0:50052", "--backend", "cpu", "--threads", "1",
        "--no-startup-probe", env={"HETCONV_TOKEN": locked_token},
    )  # fmt: skip
    refused = master.wait_for("worker refused", 60)
    assert f"{lan.ips['w2']}:50052" in refused and why in refused
    time.sleep(2)  # not retried: no "worker unreachable" lines follow
    assert not [line for line in master.lines if "unreachable" in line and ":50052" in line]
    assert w1.stop() == 0
    removed = master.wait_for("worker removed", 60)
    assert first in removed and "no longer advertised on the LAN" in removed
    # training goes on with the one that joined: it serves after the removal
    w2.skip()
    w2.wait_for("served", 30)
    w2.wait_for("served", 30)  # a whole report period after the removal
    assert master.process.poll() is None
    assert master.stop(signal.SIGINT, timeout=60) == 130  # stopped at a step boundary
    assert w2.stop() == 0
    assert locked.stop() == 0
    locked.wait_for("stopped after 0 requests", 10)  # the master never used it
    assert any("served" in line and "1 master" in line for line in w1.lines)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    events = [e for r in records for e in r.get("events", [])]
    kinds = [(e["event"], e.get("worker")) for e in events]
    assert ("worker_joined", second) in kinds
    assert ("worker_removed", first) in kinds
    assert kinds.index(("worker_joined", second)) < kinds.index(("worker_removed", first))


@pytest.mark.slow
def test_a_worker_needing_a_token_is_reported_not_used(lan):
    """A master without a token says the advertised worker needs one and trains without it."""
    w1 = lan.start("w1", *WORKER_QUIET, env={"HETCONV_TOKEN": "a-shared-secret-of-enough-length"})
    w1.wait_for("advertised on the LAN", 60)
    master = lan.start(
        "m",
        "train", "--discover", "--discover-wait", "3", "--preset", "tiny", "--batch", "8",
        "--steps", "2", "--no-progress", "--eval-size", "0",
    )  # fmt: skip
    refused = master.wait_for("not used", 60)
    assert f"{lan.ips['w1']}:50051" in refused and "requires a token" in refused
    master.wait_for("found no worker yet", 10)
    assert master.process.wait(120) == 0
    assert "a-shared-secret" not in "\n".join(master.lines)
    # a master with another token (another user's worker): reported, not a failed start
    master = lan.start(
        "m",
        "train", "--discover", "--discover-wait", "2", "--preset", "tiny", "--batch", "8",
        "--steps", "2", "--no-progress", "--eval-size", "0",
        env={"HETCONV_TOKEN": "another-secret-of-enough-length-too"},
    )  # fmt: skip
    refused = master.wait_for("not used", 60)
    assert f"{lan.ips['w1']}:50051" in refused and "refused the token" in refused
    assert master.process.wait(120) == 0, "\n".join(master.lines)


@pytest.mark.slow
def test_with_tls_a_stranger_found_on_the_lan_is_left_out(lan, tmp_path):
    """--discover --tls-ca: a plaintext worker someone else advertises fails the TLS check and
    is reported, not a failed start; the worker with our certificate is used."""
    from test_security import self_signed

    cert, key = self_signed(tmp_path, "mine", san=f"IP:{lan.ips['w2']}")
    stranger = lan.start("w1", *WORKER_QUIET)
    mine = lan.start("w2", *WORKER_QUIET, "--tls-cert", str(cert), "--tls-key", str(key))
    stranger.wait_for("hetconv worker ready on", 60)
    mine.wait_for("hetconv worker ready on", 60)
    master = lan.start(
        "m",
        "train", "--discover", "--discover-wait", "2", "--tls-ca", str(cert), "--preset", "tiny",
        "--batch", "8", "--steps", "2", "--no-progress", "--eval-size", "0",
        "--shares", "compute",
    )  # fmt: skip
    left_out = master.wait_for("not used", 60)
    assert left_out.startswith(f"found {lan.ips['w1']}:50051, not used: ") and "TLS" in left_out
    assert f"{lan.ips['w2']}:50051" in master.wait_for("found 1 worker", 10)
    assert master.process.wait(120) == 0, "\n".join(master.lines)
    mine.wait_for("served", 10)


@pytest.mark.slow
def test_a_named_worker_found_at_its_lan_address_is_used_once(lan):
    """Named as 127.0.0.1 on its own machine and found at its LAN address: one worker (the
    instance id in its advertisement), not a refusal of two addresses of one process."""
    w1 = lan.start("w1", *WORKER_QUIET)
    w1.wait_for("hetconv worker ready on", 60)
    master = lan.start(
        "w1",
        "train", "--worker", "127.0.0.1:50051", "--discover", "--discover-wait", "2",
        "--preset", "tiny", "--batch", "8", "--steps", "2", "--no-progress", "--eval-size", "0",
    )  # fmt: skip
    same = master.wait_for("the worker named as", 60)
    assert same == f"found {lan.ips['w1']}:50051: the worker named as 127.0.0.1:50051; using it"
    master.wait_for("found no other worker yet", 10)
    assert master.process.wait(120) == 0, "\n".join(master.lines)
    assert not any("one worker process" in line for line in master.lines)


def test_loopback_worker_is_not_advertised(lan):
    w = lan.start("w1", "worker", "--listen", "127.0.0.1:0", "--backend", "cpu",
                  "--no-startup-probe")  # fmt: skip
    w.wait_for("not advertised on the LAN: it listens on loopback only", 60)
    w.wait_for("hetconv worker ready on", 10)
    assert w.stop() == 0
