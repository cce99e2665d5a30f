"""Timing for the benchmarks: medians of repeated runs of compiled functions."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax


def median_seconds(fn: Callable, args: tuple, repeats: int) -> float:
    """Median wall time of `fn(*args)` (already compiled by a first, untimed call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
