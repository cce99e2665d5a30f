"""allocator.py: when a process restarts itself on huge pages, and that it restarts once, unchanged."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import allocator

ROOT = Path(__file__).resolve().parents[1]
# Prints its pid, tunables and arguments at each start, then what allocator.set_up chose.
PROBE = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
import allocator
print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
allocator.restart_with_huge_pages()
print("set up:", allocator.set_up(), flush=True)
"""


@pytest.mark.parametrize(
    "libc, mode, expected",
    [
        (("glibc", "2.36"), "always [madvise] never\n", True),
        (("glibc", "2.35"), "[always] madvise never\n", True),
        (("glibc", "2.36"), "always madvise [never]\n", False),  # huge pages off in the kernel
        (("glibc", "2.31"), "always [madvise] never\n", False),  # no hugetlb tunable before 2.35
        (("", ""), "always [madvise] never\n", False),  # musl and others
        (("glibc", "2.36"), None, False),  # no such file: not Linux's THP
    ],
)
def test_huge_pages_are_available_with_glibc_2_35_and_the_kernel_on_always_or_madvise(libc, mode, expected, tmp_path, monkeypatch):
    enabled = tmp_path / "enabled"
    if mode is not None:
        enabled.write_text(mode)
    monkeypatch.setattr(allocator, "TRANSPARENT_HUGE_PAGES", enabled)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: libc)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    assert allocator.huge_pages_available() is expected


def test_a_process_restarts_once_on_huge_pages_with_its_pid_arguments_and_other_tunables(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    environment = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}
    result = subprocess.run([sys.executable, str(probe), "--flag=1", "two words"], env=environment, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    starts = [line.split(" ", 3) for line in result.stdout.splitlines() if line.startswith("start")]
    arguments = "['--flag=1', 'two words']"
    if allocator.huge_pages_available():  # this machine (glibc 2.36, THP on madvise): one restart, then huge pages
        assert [start[2:] for start in starts] == [
            ["glibc.malloc.tcache_count=7", arguments],
            ["glibc.malloc.tcache_count=7:glibc.malloc.hugetlb=1", arguments],
        ]
        assert starts[0][1] == starts[1][1]  # exec: the same process
        assert result.stdout.splitlines()[-1] == "set up: huge pages"
    else:  # no restart; freed memory is kept instead
        assert [start[2:] for start in starts] == [["glibc.malloc.tcache_count=7", arguments]]
        assert result.stdout.splitlines()[-1] in ("set up: freed memory kept", "set up: malloc's defaults")


def test_without_huge_pages_nothing_restarts_and_freed_memory_is_kept(tmp_path, monkeypatch):
    enabled = tmp_path / "enabled"
    enabled.write_text("always madvise [never]\n")
    monkeypatch.setattr(allocator, "TRANSPARENT_HUGE_PAGES", enabled)
    monkeypatch.setattr(allocator.os, "execv", lambda *args: pytest.fail(f"restarted: {args}"))
    monkeypatch.setenv("GLIBC_TUNABLES", "")
    allocator.restart_with_huge_pages()  # returns: the kernel has huge pages off
    assert os.environ["GLIBC_TUNABLES"] == ""
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: True)  # mallopt itself is left alone in the test process
    assert allocator.set_up() == "freed memory kept"
