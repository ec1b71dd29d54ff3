"""Reaching the workers when a training starts: describe each, measure its link, refuse one
process named twice, and measure whether the workers share one medium.

A worker that does not answer in ``connect_timeout`` is not an error here: the cluster starts
it lost and the monitor retries it. A token the worker refuses or a failed TLS handshake is:
no retry fixes a configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from . import probing
from .call import Call
from .client import WorkerAuthError, WorkerError, WorkerTLSError
from .config import ClusterConfig
from .membership import Node


def connect(node: Node, config: ClusterConfig, timeout: float | None = None) -> None:
    """Describe ``node`` and measure its link (:func:`.probing.connect`)."""
    deadline = max(config.deadline_floor, 10.0)
    probing.connect(node, config.connect_timeout, deadline, timeout)


def reach_workers(workers: Sequence[Node], config: ClusterConfig) -> dict[str, WorkerError]:
    """Describe every worker at once (absent workers cost ``connect_timeout`` once, not each),
    then measure each link one at a time (the measurements must not share the link); returns
    worker name -> why it could not be reached.

    Raises:
        WorkerAuthError, WorkerTLSError: a worker refused the token, or its TLS handshake
            failed.
        ValueError: two addresses reach one worker process.
    """
    calls = [(node, Call(node.client.describe)) for node in workers]
    unreachable: dict[str, WorkerError] = {}
    for node, call in calls:
        try:
            call.result()
        except (WorkerAuthError, WorkerTLSError):
            raise
        except WorkerError as e:
            unreachable[node.name] = e
    for node in workers:
        if node.name not in unreachable:
            try:
                connect(node, config)
            except (WorkerAuthError, WorkerTLSError):
                raise
            except WorkerError as e:
                unreachable[node.name] = e
    refuse_aliases([n for n in workers if n.name not in unreachable])
    return unreachable


def refuse_aliases(nodes: Sequence[Node]) -> None:
    """Refuse one worker process (its Describe's ``instance_id``) under two addresses: each
    name would get its own share of every layer, so the user surely meant two machines.

    Raises:
        ValueError: naming both addresses.
    """
    seen: dict[int, Node] = {}
    for node in nodes:
        if not node.instance_id:
            continue
        first = seen.setdefault(node.instance_id, node)
        if first is not node:
            raise ValueError(
                f"workers {first.name} and {node.name} are one worker process (instance id "
                f"{node.instance_id:016x}) under two addresses: name it once (each name "
                "would get its own share of every layer)"
            )


def measure_medium(
    workers: Sequence[Node], config: ClusterConfig, emit: Callable[..., None]
) -> probing.Medium | None:
    """Whether the workers share one medium and what they carry together; None when no worker
    was reached or one failed its echo (event ``network_unmeasured``: it is left to the first
    step, where it is lost and retried as usual)."""
    if not workers:
        return None
    deadline = config.deadline_floor + config.deadline_factor
    try:
        if all(probing.on_this_machine(node.name) for node in workers):  # loopback: no medium
            return probing.loopback_medium(list(workers), deadline)
        return probing.measure_medium(list(workers), deadline)
    except WorkerError as e:
        emit("network_unmeasured", reason=str(e))
        return None


__all__ = ["connect", "measure_medium", "reach_workers", "refuse_aliases"]
