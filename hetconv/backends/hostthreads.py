"""How many threads host compute may use, and a pool to run parts of a call on them.

The count is the BLAS library's (``threadpoolctl``'s limit): ``--threads``, a testbed's
``OPENBLAS_NUM_THREADS=1`` and an embedded cluster's limit for its master hold for every engine
and layer alike. The pool runs contiguous groups of a call's parts, the first on the calling
thread; each part computes what it computes alone, so the bits do not depend on the count.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

_blas: list | None = None
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def blas_threads() -> int:
    """The BLAS library's thread count now (its lowest, with several), else the CPU count."""
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController

        _blas = ThreadpoolController().select(user_api="blas").lib_controllers
    counts = [c.num_threads for c in _blas]
    return max(1, min(counts)) if counts else (os.cpu_count() or 1)


def groups(total: int, parts: int, block: int = 1) -> list[tuple[int, int]]:
    """``[0, total)`` cut into at most ``parts`` contiguous ranges, as even as whole blocks of
    ``block`` allow (the last block may be short); none empty."""
    blocks = -(-total // block)
    parts = max(1, min(parts, blocks))
    cuts = [min(total, blocks * i // parts * block) for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def in_groups(work: Callable[[Any], T], items: Sequence, threads: int) -> list[T]:
    """``[work(item) for item in items]``, the items in ``threads`` contiguous groups run at
    once (the first on the calling thread, the others on the module's pool), each group in
    order. Returns when every group is done; raises the first failure."""
    if threads <= 1 or len(items) < 2:
        return [work(item) for item in items]
    ranges = groups(len(items), threads)
    pool = shared_pool()
    futures = [pool.submit(lambda a=a, b=b: [work(i) for i in items[a:b]]) for a, b in ranges[1:]]
    try:
        first = [work(item) for item in items[ranges[0][0] : ranges[0][1]]]
    finally:
        wait(futures)  # every group done before the caller goes on
    return first + [result for future in futures for result in future.result()]


def shared_pool() -> ThreadPoolExecutor:
    """The module's thread pool (a thread a CPU), made on first use: the threads beside the
    calling one that the engines' and the layers' parts run on."""
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="hetconv-host")
    return _pool


__all__ = ["blas_threads", "groups", "in_groups", "shared_pool"]
