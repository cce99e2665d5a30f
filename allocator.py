"""Where a train step's buffers come from: glibc's malloc, on transparent huge pages where it can.

XLA's CPU runtime allocates each execution's temporary buffer (1.4 GiB for the
`kjv_web_transformer` step) with malloc and frees it at the step's end. Left at
its defaults, glibc maps a block that large afresh every step and unmaps it when
freed, so each step faults it back in 4 KiB at a time (on that step: 800,000
minor faults and 0.75 s of kernel time per 2.8 s step). Two ways out:

- `restart_with_huge_pages`: glibc's `glibc.malloc.hugetlb=1` tunable (glibc
  2.35+, read at process start) backs malloc's mappings with 2 MiB transparent
  huge pages: the block is still mapped afresh every step, but in 700 faults, and
  freed memory goes back to the system, so the process holds one step's buffers.
- `keep_freed_memory` (where the tunable cannot be had): one arena, no mapping and
  no trimming, so freed memory stays in the heap for the next step. As fast, but
  the heap fragments: a few small allocations between steps land in the freed
  block, the next step's block no longer fits and the heap grows by another
  1.4 GiB (2.4 to 5.2 GiB over identical runs).

Measured on the 4.5M-pair corpus: docs/performance.md, "What each choice is worth".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
from pathlib import Path

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
TRANSPARENT_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # e.g. "always [madvise] never"


def huge_pages_available() -> bool:
    """Linux, glibc 2.35 or later (the tunable), and transparent huge pages on `always` or `madvise`."""
    library, version = platform.libc_ver()
    if not sys.platform.startswith("linux") or library != "glibc" or tuple(map(int, version.split(".")[:2])) < (2, 35):
        return False
    try:
        mode = TRANSPARENT_HUGE_PAGES.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def huge_pages_in_effect() -> bool:
    """Whether this process started with the tunable (glibc reads it only then)."""
    return HUGE_PAGES_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":") and huge_pages_available()


def restart_with_huge_pages() -> None:
    """Runs this program again in this process (`exec`: same pid, arguments and environment) with the
    huge-pages tunable added to `GLIBC_TUNABLES`; returns at once where it is in effect already or
    unavailable. Call it first thing in a program's `__main__`, before imports start threads."""
    if huge_pages_in_effect() or not huge_pages_available():
        return
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), HUGE_PAGES_TUNABLE]))
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def set_up() -> str:
    """Before JAX starts its threads: nothing where huge pages are in effect, else `keep_freed_memory`.
    Returns which ("huge pages", "freed memory kept" or "malloc's defaults")."""
    if huge_pages_in_effect():
        return "huge pages"
    return "freed memory kept" if keep_freed_memory() else "malloc's defaults"


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
