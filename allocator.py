"""Keeping freed memory in the process: glibc's malloc gives large freed blocks back to the kernel.

XLA's CPU runtime allocates each execution's buffers (GiBs for a Transformer
step) with malloc and frees them at its end. glibc serves blocks that large
with mmap from per-thread arenas and unmaps them when freed, so every step
faults all of that memory back in, page by page: on `kjv_web_transformer`
without these settings, 800,000 minor page faults and 0.75 s of kernel time per
2.8 s step. With one arena, no mmap and no trimming, the heap keeps its peak
size and a step's buffers reuse the previous step's pages (the step with and
without: docs/performance.md, "What each choice is worth").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to one arena, no mmap and no trimming; call it before JAX starts its
    threads (its backend starts them when it is first used). Returns whether it was set (only
    glibc on Linux has these knobs)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: nothing to set
        return False
    # -1 as the trim threshold is SIZE_MAX to glibc: never trim.
    done = all(mallopt(parameter, value) == 1 for parameter, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
    if not done:
        logging.warning("glibc's mallopt refused a setting: freed memory may go back to the kernel")
    return done
