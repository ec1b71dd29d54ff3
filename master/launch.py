"""Start worker processes on this machine (the embedded default and the tests use this)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time

from hetconv.calls import READY
from hetconv.conv import ConvExecutor
from hetconv.security import TOKEN_ENV, check_token


def stop_processes(processes, timeout: float = 10.0) -> None:
    """Ask each process to stop (terminate: SIGTERM, graceful for a worker), wait up to
    ``timeout`` seconds for all of them together, then kill what is left."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class LocalWorkers:
    """``count`` real ``hetconv worker`` processes listening on loopback ports.

    Args:
        count: how many.
        backend: the backend each serves.
        blas_threads: BLAS threads per worker; the workers share this machine's cores with the
            master, so 1 keeps them from oversubscribing it.
        startup_timeout: seconds to wait for each to say it is ready.
        token: a shared secret the workers require of every call (None: none, even when
            ``HETCONV_TOKEN`` is set here). It reaches them through ``HETCONV_TOKEN`` in their
            environment, not their command line, which any user can read with ``ps``.

    Use as a context manager; leaving it stops every process it started, also on Ctrl-C.
    The workers also stop by themselves when this process ends without stopping them (they
    watch the pipe to their standard input).
    """

    def __init__(
        self,
        count: int,
        backend: str = "cpu",
        blas_threads: int | None = 1,
        startup_timeout: float = 120.0,
        token: str | None = None,
    ):
        if count < 1:
            raise ValueError(f"local worker count must be >= 1, got {count}")
        self.token = check_token(token, "token") if token is not None else None
        self.count, self.backend = count, backend
        self.blas_threads, self.startup_timeout = blas_threads, startup_timeout
        self.processes: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self._output: list[collections.deque[str]] = []

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(TOKEN_ENV, None)  # only the token asked for, never one inherited by accident
        if self.token is not None:
            env[TOKEN_ENV] = self.token
        if self.blas_threads:
            for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env[name] = str(self.blas_threads)
        return env

    def start(self) -> list[str]:
        """Start the processes and wait until each serves; returns their addresses."""
        command = [
            # -I: never import a source tree in the working directory instead of the installed
            # package (cwd comes first on sys.path for -m).
            sys.executable, "-I", "-m", "hetconv", "worker", "--listen", "127.0.0.1:0",
            "--backend", self.backend, "--no-startup-probe", "--exit-on-stdin-close",
        ]  # fmt: skip
        ready: list[threading.Event] = []
        found: list[str | None] = []
        for i in range(self.count):
            process = subprocess.Popen(
                command,
                # Their stdin is a pipe only this process writes: when it ends, however it
                # ends, the pipe closes and the workers stop (--exit-on-stdin-close).
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self._env(),
                text=True,
                # Their own session: a Ctrl-C at the terminal reaches only the master, which
                # finishes its step (and checkpoint) with the workers still serving, then
                # stops them itself.
                start_new_session=True,
            )
            self.processes.append(process)
            lines: collections.deque[str] = collections.deque(maxlen=40)
            self._output.append(lines)
            event = threading.Event()
            ready.append(event)
            found.append(None)
            threading.Thread(
                target=self._drain, args=(process, lines, event, found, i), daemon=True
            ).start()
        deadline = time.monotonic() + self.startup_timeout
        for i, event in enumerate(ready):
            while not event.wait(0.1):
                if self.processes[i].poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    why = (
                        f"exited with status {self.processes[i].returncode}"
                        if self.processes[i].returncode is not None
                        else f"was not ready after {self.startup_timeout:.0f} s"
                    )
                    output = "\n".join(self._output[i]) or "(no output)"
                    raise RuntimeError(f"local worker {i + 1} {why}:\n{output}")
        self.addresses = [a for a in found if a is not None]
        return self.addresses

    @staticmethod
    def _drain(process, lines, event, found, index) -> None:
        # Keep reading so a chatty worker never blocks on a full pipe.
        for line in process.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if line.startswith(READY):
                found[index] = line[len(READY) :].strip()
                event.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every process to stop (SIGTERM: graceful), then kill what is left."""
        stop_processes(self.processes, timeout)
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()

    def __enter__(self) -> LocalWorkers:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedCluster(ConvExecutor):
    """A :class:`~hetconv.master.cluster.Cluster` over local worker processes that it starts
    when training is ready to begin (so bad arguments fail before any process starts) and
    stops on :meth:`close`. The executor of ``hetconv train`` with no workers named.

    Args:
        count: worker processes to start.
        config: the cluster's settings.
        cluster_class: the cluster to run over them: :class:`~hetconv.master.cluster.Cluster`
            (None), or :class:`~hetconv.master.imagesplit.ImageSplit` (the whole network
            split by images).
        backend: the backend of the master's own share and of the workers it starts.
    """

    def __init__(self, count: int, config=None, cluster_class=None, backend: str = "cpu"):
        # The master sends config.token; its local workers require the same.
        token = config.token if config is not None else None
        self.workers = LocalWorkers(count, backend=backend, token=token)
        self.backend = backend  # the master's own share's, and its workers' (--engine)
        self.config = config
        self.cluster = None
        self.cluster_class = cluster_class
        self._blas_limit = None
        if cluster_class is not None:  # how the model groups its layers, known before prepare
            self.supports_stages = cluster_class.supports_stages
            self.supports_head = cluster_class.supports_head

    def master_blas_threads(self) -> int:
        """BLAS threads the master keeps while its workers share this machine: the cores the
        workers' threads leave, at least one. More threads than cores in all makes OpenBLAS's
        spinning threads fight: on 2 cores beside 2 one-thread workers, 100 tiny steps of the
        embedded default took 7.1-7.7 s with the master on 2 threads and 6.0-6.1 s on 1
        (three interleaved runs each)."""
        taken = self.workers.count * (self.workers.blas_threads or 1)
        return max(1, (os.cpu_count() or 1) - taken)

    def prepare(self, layers, batch, log) -> None:
        from threadpoolctl import threadpool_limits

        from hetconv.master.cluster import Cluster

        threads = self.master_blas_threads()
        if log is not None:
            print(
                f"starting {self.workers.count} local worker processes on loopback, "
                f"{self.workers.blas_threads or 'default'} BLAS thread(s) each and {threads} "
                f"for the master (name real ones with --worker HOST:PORT; --local for none)",
                file=log,
            )
        # Before the probe, so the shares measure the master as it will train.
        self._blas_limit = threadpool_limits(limits=threads, user_api="blas")
        cluster_class = self.cluster_class or Cluster
        self.cluster = cluster_class(self.workers.start(), backend=self.backend, config=self.config)
        self.cluster.prepare(layers, batch, log)

    def train_batch(self, model, x, labels, step):
        return self.cluster.train_batch(model, x, labels, step)

    def forward(self, layer, x, w, b, padding):
        return self.cluster.forward(layer, x, w, b, padding)

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        return self.cluster.backward(layer, x, w, dy, padding, need_input_grad)

    def backward_kernels_first(self, layer, x, w, dy, padding, need_input_grad):
        return self.cluster.backward_kernels_first(layer, x, w, dy, padding, need_input_grad)

    supports_stages = True  # fused stages (hetconv.stages), as the cluster runs them
    distributed = True

    def stage_mode(self, layer):
        return self.cluster.stage_mode(layer)

    def stage_forward(self, layer, x, w, b, padding, stage, batchnorm=(), head=None):
        return self.cluster.stage_forward(layer, x, w, b, padding, stage, batchnorm, head)

    def stage_backward(
        self, layer, x, w, b, dy, padding, need_input_grad, stage, batchnorm=(), head=None
    ):
        return self.cluster.stage_backward(
            layer, x, w, b, dy, padding, need_input_grad, stage, batchnorm, head
        )

    def hold_block_backward(self, layer: str, chain) -> None:
        self.cluster.hold_block_backward(layer, chain)

    def block_backward_taken(self, layer: str) -> bool:
        return self.cluster.block_backward_taken(layer)

    supports_head = True  # the final fc split over the last stage's slices (hetconv.head)

    def head_split(self, layer: str) -> bool:
        return self.cluster.head_split(layer)

    # Resident kernels (hetconv.master.resident), as the cluster keeps them.
    def resident_layers(self) -> list[str]:
        return self.cluster.resident_layers()

    def resident_parameters(self) -> list[str]:
        return self.cluster.resident_parameters()

    def attach_optimizer(self, sgd) -> None:
        self.cluster.attach_optimizer(sgd)

    def gather_resident(self) -> dict:
        return self.cluster.gather_resident()

    def load_resident_momentum(self, momentum: dict) -> None:
        self.cluster.load_resident_momentum(momentum)

    def begin_step(self, step: int) -> None:
        self.cluster.begin_step(step)

    def end_step(self) -> dict:
        return self.cluster.end_step()

    def redo_step(self) -> bool:
        return self.cluster.redo_step()

    def complete(self) -> None:
        if self.cluster is not None:
            self.cluster.complete()

    def plan_record(self) -> dict:
        return self.cluster.plan_record()

    def predict_step(
        self, comp_alone_s: float, comp_s: float, spec=None, chains_s=None
    ) -> dict | None:
        return self.cluster.predict_step(comp_alone_s, comp_s, spec, chains_s)

    @property
    def wire_format(self) -> str:
        """The format of activations on the wire (known before the workers start)."""
        return self.config.wire_format.label if self.config is not None else "float32"

    def close(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.workers.stop()
            if self._blas_limit is not None:
                self._blas_limit.restore_original_limits()
                self._blas_limit = None
