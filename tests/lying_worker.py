"""A real gRPC worker that answers finite but wrong values: for the spot-check tests and
``benchmarks/spot_checks.py``.

    python -I tests/lying_worker.py KIND FROM_STEP [SEED]

serves the real ``ConvWorkerService`` on the cpu backend on a free loopback port, prints
``READY HOST:PORT``, and from training step FROM_STEP on changes its answers (feature maps, or
kernel, bias and input gradients; fused stage outputs and their gradients alike) in place
before they are sent, by KIND:

* ``scale``: every value times 1.5 (a lie a glance at the loss would not show);
* ``kernel``: the first kernel of its slice only: its feature maps, kernel and bias
  gradients times 1.5 (input gradients untouched: the hardest for a sampler);
* ``noise``: every value times ``1 + 1e-3 * N(0, 1)`` (a small relative perturbation);
* ``honest``: nothing (the same process, answering right: the control);

and, as a peer of a block split by images (``--replicate split``, ``split_all``), in what it
puts into the other workers only (its own answers stay right):

* ``parts``: the block output of its images times 1.5;
* ``rows``: the input-gradient rows of the others' images times 1.5;
* ``withhold``: nothing at all (its peers wait for parts that never come);
* ``farstep``: besides each right part, one naming step 2**64-1;
* ``output``: the block output of its images times 1.5 wherever it goes (its peers, the
  master's FetchPart, its own stage calls): a consistent liar.

and, in what spot checks of the default modes (resident kernels, a split head) must catch:

* ``every_other``: every other forward answer (of any call) times 1.5, the others right;
* ``update``: each SGD update of its resident slices (weights, biases, fc columns) times 1.01;
* ``head``: a split head's partial logits times 1.5;

and, in a split by images with the ring (``--exchange ring``), what the ring's checks
(:mod:`hetconv.master.ringcheck`) must catch:

* ``ring_own``: its own gradient times 1.5 before the ring sums it (its sketches of it true);
* ``ring_pass``: every part of the gradient's ring it takes from a peer times 1.5 (its own
  gradient and sketches right);
* ``ring_bn``: every part of batch norm's sums it takes from a peer times 1.5 (it normalises
  by wrong statistics; what it puts into its peers right).

It stops when its standard input closes or on SIGTERM.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from hetconv.backends import get_backend
from hetconv.calls import READY
from hetconv.proto import worker_pb2 as pb
from hetconv.ring import MASTER_ROUND, ROUNDS_PER_SUM
from hetconv.worker import resident as resident_module
from hetconv.worker import ring as ring_module
from hetconv.worker import service as service_module
from hetconv.worker.resident import ResidentCalls
from hetconv.worker.service import ConvWorkerService, start_server
from hetconv.worker.split import SplitCalls
from hetconv.worker.stages import StageCalls

ANSWERS = ("scale", "kernel", "noise", "honest")
PARTS = ("parts", "rows", "withhold", "farstep", "output")
KINDS = ANSWERS + PARTS
SAMPLED = ("every_other", "update", "head")  # the spot checks' lies, below
RING = ("ring_own", "ring_pass", "ring_bn")
KINDS += SAMPLED + RING


class LyingService(ConvWorkerService):
    """Computes like any worker, then changes the answer from step ``from_step`` on."""

    def __init__(self, kind: str, from_step: int, seed: int = 0):
        super().__init__(get_backend("cpu"))
        if kind not in KINDS:
            raise ValueError(f"lie {kind!r} is not one of {', '.join(KINDS)}")
        self.kind, self.from_step = kind, from_step
        self.rng = np.random.default_rng(seed)
        self.step = -1

    def _receive(self, messages, call, *progress):
        request, arrays, receive = super()._receive(messages, call, *progress)
        self.step = request.step  # the master calls a worker one call at a time
        return request, arrays, receive

    def _lie(self, phase: str, arrays: list[np.ndarray]) -> None:
        if self.kind in SAMPLED:
            return lie_sampled(self, phase, arrays)
        if self.step < self.from_step or self.kind in ("honest", *PARTS, *RING):
            return
        if self.kind == "kernel":
            if phase == "forward":
                arrays[0][:, 0] *= 1.5  # y (N, K, Ho, Wo)
            else:
                arrays[0][0] *= 1.5  # dw (K, C, kh, kw)
                arrays[1][0] *= 1.5  # db (K,)
            return
        for a in arrays:
            if self.kind == "scale":
                a *= 1.5
            else:
                a *= 1 + 1e-3 * self.rng.standard_normal(a.shape).astype(np.float32)

    def forward(self, messages):
        tensors, compute, receive = super().forward(messages)
        self._lie("forward", [a for _, a, _ in tensors])
        return tensors, compute, receive

    def backward(self, messages):
        tensors, compute, receive = super().backward(messages)
        self._lie("backward", [a for _, a, _ in tensors])
        return tensors, compute, receive


class LyingSplitCalls(SplitCalls):
    """The split block's exchange (:mod:`hetconv.worker.split`), lying in the parts it puts
    into its peers as its service's kind says."""

    service: LyingService

    def forward(self, request, x, run, y):
        if self.service.kind == "output" and request.step >= self.service.from_step:
            y *= np.float32(1.5)  # what it keeps, puts and answers alike
        return super().forward(request, x, run, y)

    def _send(self, request, layout, rows, gradient: bool, round_: int, nodes=None):
        liar = self.service
        if request.step < liar.from_step or liar.kind not in PARTS or liar.kind == "output":
            return super()._send(request, layout, rows, gradient, round_, nodes)
        if liar.kind == "withhold":
            return None
        if liar.kind == "farstep":
            far = pb.ConvRequest()
            far.CopyFrom(request)
            far.step = 2**64 - 1
            super()._send(far, layout, rows, gradient, round_, nodes)
            return super()._send(request, layout, rows, gradient, round_, nodes)
        wrong = (liar.kind == "parts") != gradient  # parts: outputs; rows: gradient rows
        scaled = (lambda node: rows(node) * np.float32(1.5)) if wrong else rows
        return super()._send(request, layout, scaled, gradient, round_, nodes)


class LyingStageCalls(StageCalls):
    """The fused stage calls (:mod:`hetconv.worker.stages`), lying as their service does."""

    def forward(self, messages):
        tensors, compute, receive = super().forward(messages)
        self.service._lie("forward", [a for _, a, _ in tensors])
        return tensors, compute, receive

    def backward(self, messages):
        tensors, compute, receive = super().backward(messages)
        self.service._lie("backward", [a for _, a, _ in tensors])
        return tensors, compute, receive


# -- the spot checks' lies ---------------------------------------------------------------------


def lie_sampled(liar: LyingService, phase: str, arrays: list[np.ndarray]) -> None:
    """``every_other``: every other forward answer (y, or a split head's logits) times 1.5."""
    if liar.kind != "every_other" or phase != "forward" or liar.step < liar.from_step:
        return
    liar.forwards = getattr(liar, "forwards", 0) + 1
    if liar.forwards % 2 == 0:
        for a in arrays[:2]:  # a resident stage's y and z; not its batch statistics
            a *= 1.5


class LyingResidentCalls(ResidentCalls):
    """The resident kernel calls (:mod:`hetconv.worker.resident`), lying as their service's
    kind says: in their forward answers (``every_other``, ``head``)."""

    service: LyingService

    def forward(self, messages):
        out = super().forward(messages)
        liar = self.service
        if isinstance(out, tuple) and liar.step >= liar.from_step:
            tensors = out[0]
            if liar.kind == "head" and tensors[1][1].size:
                tensors[1][1][...] *= 1.5  # z: the partial logits
            else:
                lie_sampled(liar, "forward", [a for _, a, _ in tensors])
        return out


def lying_update(liar: LyingService):
    """``update``: the worker's SGD rule with every change of a parameter times 1.01."""
    right = resident_module.sgd_update

    def sgd_update(param, grad, buf, config):
        before = np.array(param)
        momentum = right(param, grad, buf, config)
        if liar.kind == "update" and liar.step >= liar.from_step:
            param[...] = before + np.float32(1.01) * (param - before)
        return momentum

    return sgd_update


def lying_ring(liar: LyingService) -> None:
    """``ring_own`` and ``ring_pass``: the ring's bucket intake and its filing of a peer's part
    patched to lie (the gradient's rounds only, not batch norm's sums)."""
    ready, file = ring_module.BucketRing.ready, ring_module.RingCalls.file

    def lying_ready(self, index, gradient):
        if liar.kind == "ring_own" and liar.step >= liar.from_step:
            gradient = np.asarray(gradient) * np.float32(1.5)
        return ready(self, index, gradient)

    def lying_file(self, session, step, round_, segment, part):
        gradient = round_ < ROUNDS_PER_SUM  # else a batch norm sum's (or the master's part)
        lies = {"ring_pass": gradient, "ring_bn": ROUNDS_PER_SUM <= round_ < MASTER_ROUND}
        if lies.get(liar.kind) and step >= liar.from_step:
            part = np.asarray(part) * np.float32(1.5)
        return file(self, session, step, round_, segment, part)

    ring_module.BucketRing.ready = lying_ready
    ring_module.RingCalls.file = lying_file


def main(argv: list[str]) -> int:
    kind, from_step = argv[0], int(argv[1])
    seed = int(argv[2]) if len(argv) > 2 else 0
    liar = LyingService(kind, from_step, seed)
    LyingSplitCalls.service = liar
    liar.context.split = LyingSplitCalls(liar.context)  # before the server takes its handlers
    LyingStageCalls.service = liar  # the stage handlers lie as their service does
    service_module.StageCalls = LyingStageCalls  # start_server builds the stage handlers
    LyingResidentCalls.service = liar
    service_module.ResidentCalls = LyingResidentCalls
    resident_module.sgd_update = lying_update(liar)
    lying_ring(liar)
    server, address = start_server(liar, "127.0.0.1:0")
    print(READY, address, flush=True)
    stop = threading.Event()

    def watch_stdin() -> None:
        try:
            while sys.stdin.buffer.read1(1 << 16):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
