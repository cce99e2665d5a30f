"""utils/allocator.py: when a process restarts itself on huge pages, and that it restarts once, unchanged."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from utils import allocator

ROOT = Path(__file__).resolve().parents[1]
# Prints its pid, tunables, arguments and an interpreter option at each start, then what allocator.set_up chose.
PROBE = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from utils import allocator
print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.flags.utf8_mode, sys.argv[1:], flush=True)
allocator.restart_with_huge_pages(__file__)
print("set up:", allocator.set_up(), flush=True)
"""
ARGUMENTS = ["--flag=1", "two words"]


def run_probe(tmp_path, tunables: str) -> tuple[list[list[str]], str]:
    """The probe run as `python -X utf8 probe.py ARGUMENTS`: its start lines, split, and its last line."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    environment = {k: v for k, v in os.environ.items() if k != allocator.RESTARTED} | {"GLIBC_TUNABLES": tunables}
    result = subprocess.run(
        [sys.executable, "-X", "utf8", str(probe), *ARGUMENTS],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    starts = [line.split(" ", 4) for line in result.stdout.splitlines() if line.startswith("start")]
    return starts, result.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    "libc, mode, status, expected",
    [
        (("glibc", "2.36"), "always [madvise] never\n", "THP_enabled:\t1\n", True),
        # kernels before 6.0 have no THP_enabled line
        (("glibc", "2.35"), "[always] madvise never\n", "Name:\tpython\n", True),
        # huge pages off in the kernel
        (("glibc", "2.36"), "always madvise [never]\n", "THP_enabled:\t1\n", False),
        # off for this process (prctl)
        (("glibc", "2.36"), "always [madvise] never\n", "THP_enabled:\t0\n", False),
        # no hugetlb tunable before 2.35
        (("glibc", "2.31"), "always [madvise] never\n", "THP_enabled:\t1\n", False),
        # a version it cannot read
        (("glibc", "2.x"), "always [madvise] never\n", "THP_enabled:\t1\n", False),
        # musl and others
        (("", ""), "always [madvise] never\n", "THP_enabled:\t1\n", False),
        # no such file: not Linux's THP
        (("glibc", "2.36"), None, "THP_enabled:\t1\n", False),
    ],
)
def test_huge_pages_are_available_with_glibc_2_35_and_the_kernel_on_always_or_madvise(
    libc, mode, status, expected, tmp_path, monkeypatch
):
    enabled, process = tmp_path / "enabled", tmp_path / "status"
    if mode is not None:
        enabled.write_text(mode)
    process.write_text(status)
    monkeypatch.setattr(allocator, "TRANSPARENT_HUGE_PAGES", enabled)
    monkeypatch.setattr(allocator, "PROCESS_STATUS", process)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: libc)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    assert allocator.huge_pages_available() is expected


def test_the_last_entry_of_a_tunable_wins(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1:glibc.malloc.tcache_count=7:glibc.malloc.hugetlb=0")
    assert allocator.tunable_value("glibc.malloc.hugetlb") == "0"
    assert allocator.tunable_value("glibc.malloc.tcache_count") == "7"
    assert allocator.tunable_value("glibc.malloc.mmap_max") is None


@pytest.mark.skipif(
    not allocator.huge_pages_available(), reason="the restart needs glibc 2.35+ and transparent huge pages"
)
def test_a_process_restarts_once_on_huge_pages_with_its_pid_arguments_options_and_other_tunables(tmp_path):
    starts, last = run_probe(tmp_path, "glibc.malloc.tcache_count=7")
    arguments = repr(ARGUMENTS)
    assert [start[2:] for start in starts] == [
        ["glibc.malloc.tcache_count=7", "1", arguments],
        # `-X utf8` kept
        ["glibc.malloc.tcache_count=7:glibc.malloc.hugetlb=1", "1", arguments],
    ]
    # exec: the same process
    assert starts[0][1] == starts[1][1]
    assert last == "set up: huge pages"


def test_a_users_own_hugetlb_setting_is_kept_and_nothing_restarts(tmp_path):
    # the opt-out
    starts, last = run_probe(tmp_path, "glibc.malloc.hugetlb=0")
    assert [start[2:] for start in starts] == [["glibc.malloc.hugetlb=0", "1", repr(ARGUMENTS)]]
    assert last == "set up: freed memory kept"


def test_nothing_restarts_after_a_restart_or_for_a_program_not_run_as_the_script(tmp_path, monkeypatch):
    monkeypatch.setattr(allocator.os, "execv", lambda *args: pytest.fail(f"restarted: {args}"))
    monkeypatch.setattr(allocator, "huge_pages_available", lambda: True)
    monkeypatch.setenv("GLIBC_TUNABLES", "")
    script = tmp_path / "train.py"
    monkeypatch.setattr(allocator.sys, "argv", [str(script)])
    monkeypatch.setenv(allocator.RESTARTED, "1")
    # restarted once already (a lost tunable would loop)
    allocator.restart_with_huge_pages(str(script))
    monkeypatch.delenv(allocator.RESTARTED)
    # stdin, a command, runpy from another script
    for argv0 in ("-", "-c", str(tmp_path / "other.py")):
        monkeypatch.setattr(allocator.sys, "argv", [argv0])
        allocator.restart_with_huge_pages(str(script))
    assert os.environ["GLIBC_TUNABLES"] == ""


def test_without_huge_pages_nothing_restarts_and_freed_memory_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(allocator, "huge_pages_available", lambda: False)
    monkeypatch.setattr(allocator.os, "execv", lambda *args: pytest.fail(f"restarted: {args}"))
    monkeypatch.setattr(allocator.sys, "argv", [str(ROOT / "train.py")])
    monkeypatch.setenv("GLIBC_TUNABLES", "")
    allocator.restart_with_huge_pages(str(ROOT / "train.py"))
    assert os.environ["GLIBC_TUNABLES"] == ""
    kept = []
    # mallopt itself is left alone here
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: kept.append(True) or True)
    assert allocator.set_up() == "freed memory kept" and kept == [True]
    monkeypatch.setattr(allocator, "huge_pages_available", lambda: True)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    # huge pages: malloc left at its defaults
    assert allocator.set_up() == "huge pages" and kept == [True]


def test_a_failed_restart_puts_the_environment_back(tmp_path, monkeypatch):
    def no_interpreter(*args):
        raise FileNotFoundError(2, "No such file or directory", args[0])

    monkeypatch.setattr(allocator, "huge_pages_available", lambda: True)
    monkeypatch.setattr(allocator.os, "execv", no_interpreter)
    monkeypatch.setattr(allocator.sys, "argv", [str(ROOT / "train.py")])
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=7")
    monkeypatch.delenv(allocator.RESTARTED, raising=False)
    allocator.restart_with_huge_pages(str(ROOT / "train.py"))
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=7" and allocator.RESTARTED not in os.environ


def test_the_garbage_collector_spares_what_exists_and_still_collects_new_cycles():
    import gc
    import weakref

    class Node:
        pass

    old = Node()
    # a cycle alive before: frozen, never scanned
    old.self = old
    frozen_before = gc.get_freeze_count()
    allocator.collect_garbage_less_often()
    assert gc.get_threshold() == allocator.GC_THRESHOLDS and gc.get_freeze_count() > frozen_before
    # the frozen generation is out of the collector's reach
    assert not any(o is old for o in gc.get_objects())
    new = Node()
    new.self = new
    alive = weakref.ref(new)
    del new
    gc.collect()
    # a cycle made afterwards is collected
    assert alive() is None


def anonymous_mappings_of(size: int) -> int:
    """How many of this process's mappings are `size` bytes long (/proc/self/maps)."""
    spans = (line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines())
    return sum(int(end, 16) - int(start, 16) == size for start, end in spans)


def test_huge_pages_touched_ahead_are_mapped_until_released_and_only_where_huge_pages_are_used(monkeypatch):
    size = 6 * 2**21 + 4096
    before = anonymous_mappings_of(size)
    monkeypatch.setattr(allocator, "chosen", "malloc's defaults")
    allocator.touch_huge_pages(size)()
    assert anonymous_mappings_of(size) == before
    monkeypatch.setattr(allocator, "chosen", "huge pages")
    release = allocator.touch_huge_pages(size)
    assert anonymous_mappings_of(size) == before + 1
    release()
    assert anonymous_mappings_of(size) == before
    # nothing to touch
    allocator.touch_huge_pages(0)()
