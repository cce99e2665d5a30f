"""utils/files.py: whole-or-absent writes, digests, the locks between processes, a folder kept under a size."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from utils import files
from utils.errors import WorkdirInUse

ROOT = Path(__file__).resolve().parents[1]


def python(code: str) -> subprocess.Popen:
    """Another process running `code` with the project importable; its stdout a pipe."""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def test_write_whole_writes_a_file_and_leaves_no_temporary(tmp_path):
    files.write_whole(tmp_path / "a.txt", lambda temporary: temporary.write_text("whole"))
    assert (tmp_path / "a.txt").read_text() == "whole"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_a_failing_write_leaves_the_path_absent_or_as_it_was(tmp_path):
    def half(temporary: Path) -> None:
        temporary.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.write_whole(tmp_path / "new.txt", half)
    # absent, temporary removed
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old.txt").write_text("old")
    with pytest.raises(OSError, match="disk full"):
        files.write_whole(tmp_path / "old.txt", half)
    assert [p.name for p in tmp_path.iterdir()] == ["old.txt"]
    assert (tmp_path / "old.txt").read_text() == "old"


def test_write_whole_writes_a_folder_and_refuses_one_that_exists(tmp_path):
    source = tmp_path / "source"
    (source / "inner").mkdir(parents=True)
    (source / "inner" / "x.txt").write_text("x")
    copy = lambda temporary: shutil.copytree(source, temporary)  # noqa: E731
    files.write_whole(tmp_path / "copy", copy)
    assert (tmp_path / "copy" / "inner" / "x.txt").read_text() == "x"
    # the rename onto a folder that is not empty fails
    with pytest.raises(OSError):
        files.write_whole(tmp_path / "copy", copy)
    # the temporary folder removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "source"]


def test_digests(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "sub" / "b").write_bytes(b"")
    (tmp_path / "digests.json").write_text("{}")
    assert files.sha256(tmp_path / "a") == hashlib.sha256(b"abc").hexdigest()
    assert files.file_digests(tmp_path, skip=("digests.json",)) == {
        "a": hashlib.sha256(b"abc").hexdigest(),
        "sub/b": hashlib.sha256(b"").hexdigest(),
    }
    assert "digests.json" in files.file_digests(tmp_path)


def test_a_remembered_digest_is_computed_again_only_when_a_file_changes(tmp_path):
    corpus, absent, memo = tmp_path / "corpus.tsv", tmp_path / "absent.jpg", tmp_path / "data" / "memo.json"
    corpus.write_text("a\tb\n")
    calls = []

    def digest() -> str:
        calls.append(1)
        text = corpus.read_bytes() + (absent.read_bytes() if absent.exists() else b"-")
        return hashlib.sha256(text).hexdigest()

    first = files.remembered(memo, [corpus, absent], digest)
    assert first == hashlib.sha256(b"a\tb\n-").hexdigest() and len(calls) == 1
    assert files.remembered(memo, [corpus, absent], digest) == first and len(calls) == 1
    # the same size, a later modification time
    corpus.write_text("c\td\n")
    os.utime(corpus, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert files.remembered(memo, [corpus, absent], digest) == hashlib.sha256(b"c\td\n-").hexdigest()
    # a file that appears
    absent.write_bytes(b"x")
    assert files.remembered(memo, [corpus, absent], digest) == hashlib.sha256(b"c\td\nx").hexdigest()
    assert len(calls) == 3
    # a memo that is not one: computed again, and written whole
    memo.write_text("[1, 2")
    assert files.remembered(memo, [corpus, absent], digest) == hashlib.sha256(b"c\td\nx").hexdigest()
    assert len(calls) == 4 and isinstance(json.loads(memo.read_text()), dict)


def test_the_workdir_lock_refuses_another_process_naming_it_and_is_free_once_it_is_killed(tmp_path):
    holder = python(
        "from utils import files; import pathlib, time; "
        f"lock = files.WorkdirLock.acquire(pathlib.Path({str(tmp_path)!r})); "
        "print('held', flush=True); time.sleep(60)"
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(WorkdirInUse, match=f'in use by another run .*"pid": {holder.pid}'):
            files.WorkdirLock.acquire(tmp_path)
    finally:
        # no release, no clean-up: the kernel drops its flock
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    # taken over, the stale holder file rewritten
    lock = files.WorkdirLock.acquire(tmp_path)
    assert json.loads((tmp_path / ".lock.holder").read_text())["pid"] == os.getpid()
    lock.release()
    # twice is harmless
    lock.release()
    files.WorkdirLock.acquire(tmp_path).release()


def test_the_workdir_lock_refuses_a_second_holder_in_this_process_too(tmp_path):
    first = files.WorkdirLock.acquire(tmp_path)
    with pytest.raises(WorkdirInUse, match=f'"pid": {os.getpid()}'):
        files.WorkdirLock.acquire(tmp_path)
    # any thread may let go of it
    threading.Thread(target=first.release).start()
    time.sleep(0.1)
    files.WorkdirLock.acquire(tmp_path).release()


def test_the_blocking_lock_serialises_two_processes(tmp_path):
    path, done = tmp_path / "folder" / ".build.lock", tmp_path / "done"
    # creates the folder
    with files.exclusive(path):
        waiter = python(
            f"from utils import files; import pathlib; print('waiting', flush=True)\n"
            f"with files.exclusive(pathlib.Path({str(path)!r})): pathlib.Path({str(done)!r}).touch()"
        )
        assert waiter.stdout.readline() == "waiting\n"
        # time enough to take a free lock
        time.sleep(0.5)
        # it waits for this process
        assert waiter.poll() is None and not done.exists()
    assert waiter.wait(timeout=10) == 0
    assert done.exists()


def test_blake3_digest_is_the_published_test_vector_and_reads_in_chunks(tmp_path, monkeypatch):
    (tmp_path / "abc").write_bytes(b"abc")
    # BLAKE3's published test vector for "abc" (the BLAKE3 specification's reference implementation)
    assert (
        files.file_digest(tmp_path / "abc", "blake3")
        == "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    )
    # several chunks: the digest of the whole file all the same
    monkeypatch.setattr(files, "CHUNK_BYTES", 7)
    (tmp_path / "long").write_bytes(bytes(range(256)) * 3)
    assert files.file_digest(tmp_path / "long", "sha256") == hashlib.sha256(bytes(range(256)) * 3).hexdigest()


@pytest.mark.parametrize(
    "format", ["blake3, synchronous save", "blake3, asynchronous save", "sha256 (checkpoints saved before BLAKE3)"]
)
def test_a_checkpoint_digest_of_either_format_catches_a_flipped_byte(tmp_path, format):
    import jax.numpy as jnp

    from run_setup import checkpoints
    from utils.errors import CheckpointError

    state = {"w": jnp.arange(4096, dtype=jnp.float32)}
    writer = checkpoints.Checkpoints(tmp_path / "checkpoints", async_save=format.endswith("asynchronous save"))
    writer.save(1, state, None)
    writer.close()
    folder = tmp_path / "checkpoints" / "1"
    recorded = json.loads((folder / checkpoints.DIGEST_FILE).read_text())
    assert recorded["algorithm"] == "blake3"
    # every file but the digest and the two Orbax writes as it commits
    everything = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert set(recorded["files"]) == everything - {checkpoints.DIGEST_FILE, *checkpoints.COMMIT_RECORDS}
    if format.startswith("sha256"):
        (folder / checkpoints.DIGEST_FILE).unlink()
        legacy = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in recorded["files"]}
        (folder / checkpoints.SHA256_DIGEST_FILE).write_text(json.dumps(legacy))
    reader = checkpoints.Checkpoints(tmp_path / "checkpoints")
    # intact: it restores
    assert reader.restore({"w": state["w"]}, step=1)[0] == 1
    # in the digest, and restoring reads nothing of it: only the digest can tell
    marker = folder / "state" / "commit_success.txt"
    marker.write_bytes(bytes([marker.read_bytes()[0] ^ 0xFF]) + marker.read_bytes()[1:])
    with pytest.raises(CheckpointError, match="state/commit_success.txt is changed since it was saved"):
        reader.restore({"w": state["w"]}, step=1)
    reader.close()


def test_an_asynchronous_save_holds_its_digest_before_orbax_commits_it(tmp_path, monkeypatch):
    """A kill right after the commit (the rename of the temporary folder) finds the digest in it:
    it was written into the temporary folder, which Orbax renames whole."""
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity

    from run_setup import checkpoints

    finalize = atomicity.AtomicRenameTemporaryPath.finalize
    digest_at_commit = {}

    async def recording_finalize(self):
        # a step's folder (its items' folders are committed first, inside it)
        if self.get_final().name.isdigit():
            digest_at_commit[self.get_final().name] = (self.get() / checkpoints.DIGEST_FILE).exists()
        return await finalize(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", recording_finalize)
    writer = checkpoints.Checkpoints(tmp_path / "checkpoints")
    # another save's temporary folder (left after start-up): not the one being committed
    leftover = tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-1"
    leftover.mkdir(parents=True)
    for step in (1, 2):
        writer.save(step, {"w": jnp.full(1024, step, jnp.float32)}, None)
    writer.close()
    assert digest_at_commit == {"1": True, "2": True}
    assert not (leftover / checkpoints.DIGEST_FILE).exists()


def test_a_digest_that_cannot_be_computed_leaves_the_asynchronous_save_committed_and_unverified(
    tmp_path, monkeypatch, caplog
):
    """Hashing runs in Orbax's thread before the commit: an error there is a warning, not a lost save."""
    import jax.numpy as jnp

    from run_setup import checkpoints

    def unreadable(folder, **kwargs):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(checkpoints, "file_digests", unreadable)
    state = {"w": jnp.arange(1024, dtype=jnp.float32)}
    writer = checkpoints.Checkpoints(tmp_path / "checkpoints")
    writer.save(1, state, None)
    writer.close()
    assert "cannot write the digest of the checkpoint" in caplog.text and "it stays unverified" in caplog.text
    assert (tmp_path / "checkpoints" / "1").is_dir() and not (
        tmp_path / "checkpoints" / "1" / checkpoints.DIGEST_FILE
    ).exists()
    reader = checkpoints.Checkpoints(tmp_path / "checkpoints")
    step, restored = reader.restore({"w": state["w"]}, step=1)
    reader.close()
    assert step == 1 and (restored["w"] == state["w"]).all()


def test_pruning_removes_the_least_recently_used_entries_and_their_companions_down_to_the_size(tmp_path, monkeypatch):
    second = 10**9
    # five entries of 100 bytes used at 5, 1, 4, 2 and 3 s, each with a companion; a file of another kind
    for index, used in enumerate([5, 1, 4, 2, 3]):
        entry = tmp_path / f"k{index}-cache"
        entry.write_bytes(b"x" * 100)
        (tmp_path / f"k{index}-atime").write_bytes(b"t")
        os.utime(entry, ns=(used * second, used * second))
    (tmp_path / "memo.json").write_bytes(b"y" * 1000)
    # 500 bytes to at most 250: k1, k3 and k4 (used at 1, 2 and 3 s) go
    assert files.prune_least_recently_used(tmp_path, "-cache", 250, companions=["-atime"]) == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k0-atime", "k0-cache", "k2-atime", "k2-cache", "memo.json"]
    assert files.prune_least_recently_used(tmp_path, "-cache", 250) == 0
    # a read is a use: k2 read at 9 s (written at 4) outlives k0 (5 s)
    os.utime(tmp_path / "k2-cache", ns=(9 * second, 4 * second))
    # another process removed k0 first: passed over, counted as freed
    unlink = Path.unlink

    def removed_by_another_process(path, *args, **kwargs):
        if path.name == "k0-cache":
            unlink(path)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", removed_by_another_process)
    assert files.prune_least_recently_used(tmp_path, "-cache", 100, companions=["-atime"]) == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k2-atime", "k2-cache", "memo.json"]
