"""Where a train step's buffers come from: glibc's malloc, on transparent huge pages where it can.

XLA's CPU runtime allocates each execution's temporary buffer (1.4 GiB for the
`kjv_web_transformer` step in two microbatches, 0.67 GiB in four) with malloc and frees it at the step's end. Left at
its defaults, glibc maps a block that large afresh every step and unmaps it when
freed, so each step faults it back in 4 KiB at a time (on that step: 800,000
minor faults and 0.75 s of kernel time per 2.8 s step). Two ways out:

- `restart_with_huge_pages`: glibc's `glibc.malloc.hugetlb=1` tunable (glibc
  2.35+, read at process start) backs malloc's mappings with 2 MiB transparent
  huge pages: the block is still mapped afresh every step, but in about 700 faults
  (1.4 GiB over 2 MiB pages), and freed memory goes back to the system, so the
  process holds one step's buffers.
  A user's own `glibc.malloc.hugetlb` setting in `GLIBC_TUNABLES` is kept (`=0`
  opts out).
- `keep_freed_memory` (where the tunable cannot be had): one arena, no mapping and
  no trimming, so freed memory stays in the heap for the next step. As fast, but
  the heap fragments: a few small allocations between steps land in the freed
  block, the next step's block no longer fits and the heap grows by another
  1.4 GiB (2.4 to 5.2 GiB over identical runs).

Measured on the 4.5M-pair corpus: docs/performance.md, "A corpus of WMT14's size"; the step
with and without: "What each choice is worth".

The first step's fresh pages: `touch_huge_pages`, beside the start-up's work.

Python's own memory: `collect_garbage_less_often`, for the tracing that builds a run's programs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import mmap
import os
import platform
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
# set on the restart: a process restarts once at most
RESTARTED = "ATTEND_RESTARTED_FOR_HUGE_PAGES"
# e.g. "always [madvise] never"
TRANSPARENT_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# "THP_enabled: 0" where prctl turned them off for the process
PROCESS_STATUS = Path("/proc/self/status")


def huge_pages_available() -> bool:
    """Linux, glibc 2.35 or later (the tunable), transparent huge pages on `always` or `madvise`, and
    not turned off for this process."""
    if not sys.platform.startswith("linux"):
        return False
    library, version = platform.libc_ver()
    try:
        if library != "glibc" or tuple(int(part) for part in version.split(".")[:2]) < (2, 35):
            return False
        mode, status = TRANSPARENT_HUGE_PAGES.read_text(), PROCESS_STATUS.read_text()
    except (OSError, ValueError):
        return False
    return ("[always]" in mode or "[madvise]" in mode) and not re.search(r"^THP_enabled:\s*0\s*$", status, re.MULTILINE)


def tunable_value(name: str) -> str | None:
    """The value `GLIBC_TUNABLES` gives `name` (its last entry wins, as in glibc), or None."""
    values = [
        entry.split("=", 1)[1]
        for entry in os.environ.get("GLIBC_TUNABLES", "").split(":")
        if entry.startswith(name + "=")
    ]
    return values[-1] if values else None


def huge_pages_in_effect() -> bool:
    """Whether this process started with the tunable at 1 (glibc reads it only at the start)."""
    return tunable_value(HUGE_PAGES_TUNABLE) == "1" and huge_pages_available()


def touch_huge_pages(size: int) -> Callable[[], None]:
    """Faults in `size` bytes of 2 MiB pages in a thread, and returns `release`, which waits for the
    thread and gives the pages back: called with a train step's buffer size as a run starts, and
    released just before its first step, whose buffer then lands on pages just freed. On this
    project's virtual machine the kernel took 2.4 s per GiB of fresh huge pages (the first step of
    the WMT-sized run spent 1.7-2.0 s of system time faulting in its 0.67 GiB buffer, the later
    steps 0.1 s; docs/performance.md, "A corpus of WMT14's size"); touched in a thread, that time
    overlaps the start-up (`memset` through ctypes runs without the GIL). Nothing to touch where
    huge pages are not in effect or `size` is 0."""
    if size <= 0 or chosen != "huge pages":
        return lambda: None
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.madvise(mmap.MADV_HUGEPAGE)

    def touch() -> None:
        start = ctypes.c_char.from_buffer(pages)
        ctypes.memset(ctypes.addressof(start), 0, size)
        # the mapping closes only once no view of it is left
        del start

    thread = threading.Thread(target=touch, name="attend-huge-pages", daemon=True)
    thread.start()

    def release() -> None:
        thread.join()
        pages.close()

    return release


def restart_with_huge_pages(script: str) -> None:
    """Runs this program again in this process (`exec`: same pid, arguments and environment) with
    `glibc.malloc.hugetlb=1` added to `GLIBC_TUNABLES`, once. Returns at once where huge pages are
    unavailable, where the user set the tunable (`glibc.malloc.hugetlb=0` opts out), after a restart,
    or where the program is not `script` run as a file (`python - < train.py`, `runpy`, a notebook:
    a restart would not run it again). Call it first thing in `script`'s `__main__`."""
    started_as_script = sys.argv[0] not in ("", "-", "-c") and Path(sys.argv[0]).resolve() == Path(script).resolve()
    if (
        not started_as_script
        or RESTARTED in os.environ
        or tunable_value(HUGE_PAGES_TUNABLE) is not None
        or not huge_pages_available()
    ):
        return
    before = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [before, f"{HUGE_PAGES_TUNABLE}=1"]))
    os.environ[RESTARTED] = "1"
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError as error:
        # no interpreter to run again: go on without huge pages
        os.environ.pop(RESTARTED)
        if before is None:
            os.environ.pop("GLIBC_TUNABLES")
        else:
            os.environ["GLIBC_TUNABLES"] = before
        logging.warning("could not restart on huge pages (%s): freed memory is kept instead", error)


# Python's defaults are (700, 10, 10)
GC_THRESHOLDS = (50_000, 20, 20)


def collect_less_while_importing() -> None:
    """A process's first call, before its heavy imports: they leave hundreds of thousands of
    long-lived objects, which every full collection at Python's thresholds walks again (0.15-0.3 s
    of each start of train.py, sweep.py or a test's worker); `collect_garbage_less_often` freezes
    them once they are in."""
    gc.set_threshold(*GC_THRESHOLDS)


def collect_garbage_less_often() -> None:
    """Moves every object alive now (the imported modules, mostly) out of the collector's reach and
    raises its thresholds to `GC_THRESHOLDS`. Tracing a model allocates millions of short-lived
    objects, and at Python's defaults a full collection, which walks every long-lived object (JAX's
    caches among them), ran every few traces: 8% of the time of tests that trace and compile many
    small programs (docs/performance.md, "The test suite"). Cycles are still collected,
    after 50,000 net allocations instead of 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# what `set_up` chose for this process (malloc is the process's): the start-up summary shows it
chosen = "malloc's defaults"


def set_up() -> str:
    """Before JAX starts its threads: nothing where huge pages are in effect, else `keep_freed_memory`;
    and `collect_garbage_less_often`. Returns which ("huge pages", "freed memory kept" or "malloc's defaults"), kept in
    `chosen`."""
    global chosen
    collect_garbage_less_often()
    if huge_pages_in_effect():
        chosen = "huge pages"
    else:
        chosen = "freed memory kept" if keep_freed_memory() else "malloc's defaults"
    return chosen


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to one arena, no mmap and no trimming; call it before JAX starts its
    threads (its backend starts them when it is first used). Returns whether it was set (only
    glibc on Linux has these knobs)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        # musl and others: nothing to set
        return False
    # -1 as the trim threshold is SIZE_MAX to glibc: never trim.
    done = all(
        mallopt(parameter, value) == 1
        for parameter, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
    )
    if not done:
        logging.warning("glibc's mallopt refused a setting: freed memory may go back to the kernel")
    return done
