"""What splitting the replicated first block by images would cost on the wire (needs root).

Today every node computes the whole first block (:mod:`hetconv.replica`). If each node computed
it for its own ceil(batch / nodes) images only, every node would need the others' block
outputs before its stage, and backward would send each other node that node's images' part of
its input gradient: an all-gather forward and a reduce-scatter backward, node to node, off the
master's port on switched links. ``benchmarks/split_bound.py`` says what that would save in
compute; this measures what it would cost in time on the testbed's links
(:class:`hetconv.simulations.testbed.ClusterTestbed`: a namespace per node, tc-shaped):

* ``all_to_all_s``: every node sends its images' block outputs (float32) to every other node
  and receives theirs, all at once over TCP (one process per node, a thread per socket; the
  slowest node's time): one direction of the exchange; backward moves the same bytes the other
  way;
* ``line_rate_s``: what the link rate allows for the most a node sends or receives;
* ``via_master_s``: the bytes every worker lacks if the master sent them all (a master that
  computed the block alone and broadcast it): all through the master's port (bulk TCP, a
  process per transfer).

Bulk TCP, not gRPC: the hetconv wire costs a few per cent more (``benchmarks/transport.py``).

    sudo .venv/bin/python benchmarks/peer_exchange.py [--network paper-150-800]
        [--batches 16 64] [--workers 4] [--link switched] [--rate-mbit 940] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from hetconv.model import PRESETS, Model
from hetconv.simulations.testbed import (
    CHECK_PORT,
    LINK_KINDS,
    ClusterTestbed,
    cluster_testbed_unavailable,
)

#: One node of the exchange: it listens, connects to every peer on ``connect``, then on ``go``
#: sends ``piece`` bytes to every peer and reads as many from each, every socket in a thread of
#: its own, and prints the seconds until all is sent and received. One process per node (a
#: process per transfer would measure this machine's two cores scheduling them, not the links).
NODE = """
import socket, sys, threading, time
me, port, piece = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
peers = sys.argv[4:]
server = socket.create_server((me, port), backlog=len(peers))
print("listening", flush=True)
sys.stdin.readline()
out = [socket.create_connection((peer, port), timeout=600) for peer in peers]
inc = [server.accept()[0] for _ in peers]
for s in out + inc:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
print("connected", flush=True)
data = bytes(piece)
def send(s):
    s.sendall(data)
def receive(s):
    left, view = piece, bytearray(1 << 20)
    while left:
        n = s.recv_into(view, min(left, len(view)))
        if not n:
            raise SystemExit("a peer closed early")
        left -= n
sys.stdin.readline()
start = time.perf_counter()
threads = [threading.Thread(target=send, args=(s,)) for s in out]
threads += [threading.Thread(target=receive, args=(s,)) for s in inc]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(time.perf_counter() - start, flush=True)
"""


def exchange_seconds(bed: ClusterTestbed, piece_bytes: int, timeout: float = 120) -> float:
    """Every host sends ``piece_bytes`` to every other host at once (one process per host,
    a thread per socket); the slowest host's seconds until all it sends and receives is done."""
    nodes = []
    try:
        for host in bed.hosts:
            peers = [h.ip for h in bed.hosts if h is not host]
            command = [sys.executable, "-I", "-c", NODE, host.ip, str(CHECK_PORT),
                       str(piece_bytes), *peers]  # fmt: skip
            nodes.append(bed.spawn(command, os.environ, host, False, subprocess.PIPE))
        for step, said in (("connect", "listening"), ("go", "connected")):
            for node in nodes:
                if node.stdout.readline().strip() != said:
                    raise RuntimeError(f"an exchange node did not say {said!r}")
            for node in nodes:
                node.stdin.write(f"{step}\n")
                node.stdin.flush()
        seconds = []
        for node in nodes:
            output, _ = node.communicate(timeout=timeout)
            if node.returncode != 0:
                raise RuntimeError(f"an exchange node failed:\n{output}")
            seconds.append(float(output.split()[-1]))
        return max(seconds)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()


def block_bytes_per_image(network: str) -> int:
    """Bytes of one image's first-block output, float32 (the second convolution's input)."""
    specs = Model(PRESETS[network]).conv_specs()
    if len(specs) < 2:
        raise ValueError(f"{network} has one convolution: no block feeds a second")
    return 4 * math.prod(specs[1].input_shape)


def measure(bed: ClusterTestbed, network: str, batch: int) -> dict:
    nodes = len(bed.hosts)
    per_image = block_bytes_per_image(network)
    own = math.ceil(batch / nodes)  # the most images a node computes
    piece_mb = own * per_image / 1e6
    all_to_all = exchange_seconds(bed, own * per_image)
    sent = (nodes - 1) * piece_mb  # each node sends its piece to every other one
    received = (batch - own) * per_image / 1e6  # and receives the others' images
    line = 8 * max(sent, received) / bed.rate_mbps
    others_mb = (batch - own) * per_image / 1e6
    master_rates = bed.transfer_mbps([(bed.master, w) for w in bed.worker_hosts], others_mb)
    via_master = max(8 * others_mb / rate for rate in master_rates)
    return {
        "network": network,
        "batch": batch,
        "nodes": nodes,
        "link": bed.link,
        "rate_mbps": bed.rate_mbps,
        "piece_mb": piece_mb,
        "exchange_mb_per_node": received,
        "all_to_all_s": all_to_all,
        "line_rate_s": line,
        "via_master_s": via_master,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", default="paper-150-800", help="a preset (paper-150-800)")
    p.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    p.add_argument("--workers", type=int, default=4, help="workers beside the master (4)")
    p.add_argument("--link", choices=LINK_KINDS, default="switched")
    p.add_argument(
        "--rate-mbit", type=float, default=940.0,
        help="every link's rate, Mbit/s (940: the testbed's gigabit at its usual scale)",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = p.parse_args(argv)
    if args.network not in PRESETS:
        p.error(f"unknown network {args.network!r}; choose from {', '.join(PRESETS)}")
    if args.workers < 1 or min(args.batches) < 1 or not args.rate_mbit > 0:
        p.error("--workers, --batches and --rate-mbit must be positive")
    if os.geteuid() != 0:
        p.error("needs root (network namespaces and tc)")
    why = cluster_testbed_unavailable(args.link)
    if why is not None:
        p.error(f"the testbed cannot run here: {why}")
    try:
        block_bytes_per_image(args.network)
    except ValueError as e:
        p.error(str(e))
    print(
        f"{args.network}, {args.workers} workers + the master, {args.link} links at "
        f"{args.rate_mbit:g} Mbit/s: the first block's outputs exchanged node to node "
        "(bulk TCP, all at once)"
    )
    print(f"{'batch':>5} {'piece MB':>8} {'in MB':>6} | {'all-to-all s':>12} {'line rate s':>11} "
          f"{'via master s':>12}")  # fmt: skip
    rows = []
    with ClusterTestbed(args.workers, args.link, args.rate_mbit, cap=None) as bed:
        for batch in args.batches:
            r = measure(bed, args.network, batch)
            rows.append(r)
            print(f"{batch:5d} {r['piece_mb']:8.2f} {r['exchange_mb_per_node']:6.2f} | "
                  f"{r['all_to_all_s']:12.4f} {r['line_rate_s']:11.4f} "
                  f"{r['via_master_s']:12.4f}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
