"""Overlap of transfer and compute within a fused stage call: its modes and image groups.

A worker asked to overlap (``ConvRequest.overlap_images``) runs its fused stage on groups of
images and sends each group's output while it computes the next; its backward starts on each
group as soon as that group's gradient has arrived (the worker side: ``hetconv.worker
.overlap``). ``hetconv train --overlap`` chooses: ``on`` for every fused layer whose stage
holds no batch norm, ``off``, or ``auto``: where a worker's answer is over one message
(:func:`hetconv.costmodel.overlap_images`, which says why not below). An overlapped call
always streams, however small: one message would wait for its last group.
"""

from __future__ import annotations

import math

ON, OFF, AUTO = "on", "off", "auto"
OVERLAP_MODES = (AUTO, ON, OFF)
#: At most this many image groups per call, of at least MIN_GROUP_IMAGES images each: more
#: groups start sending sooner, but each is a smaller convolution and one more round of
#: per-group work.
MAX_GROUPS = 8
MIN_GROUP_IMAGES = 2


def group_images(batch: int) -> int:
    """Images per group for a call over ``batch`` images."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return max(MIN_GROUP_IMAGES, math.ceil(batch / MAX_GROUPS))


def group_count(batch: int, images: int) -> int:
    """Groups a call over ``batch`` images makes with ``images`` per group (0: one)."""
    return math.ceil(batch / images) if images else 1


__all__ = [
    "AUTO",
    "MAX_GROUPS",
    "MIN_GROUP_IMAGES",
    "OFF",
    "ON",
    "OVERLAP_MODES",
    "group_count",
    "group_images",
]
