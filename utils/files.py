"""Whole-or-absent writes, SHA-256 digests, locks between processes and a folder kept under a size:
one home for them.

Locks are the `filelock` package's (an `flock` the kernel releases when its
process ends, however it ends): `exclusive(path)` waits for its turn,
`WorkdirLock` refuses at once and names the run that holds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import blake3
import filelock

from utils import stop_signals
from utils.errors import WorkdirInUse


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """Makes the file or folder `path` whole or not at all: `write(temporary)` beside it (named by
    this process, so processes writing the same path do not mix), then one rename. Raises
    `OSError`, with the temporary removed, when either fails (for a folder: when it exists); the
    temporary is removed as well when `write` raises anything else, which goes on up."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        # a process ended at once (a second stop signal) removes it too
        with stop_signals.temporary(temporary):
            write(temporary)
            os.replace(temporary, path)
    except BaseException:
        # an OSError, or whatever `write` raised (bad data, Ctrl-C): nothing is left
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        raise


# Digest algorithms by name: SHA-256 for the small files (vocabularies), BLAKE3 for checkpoints
# (benchmarks/checkpoint_restore_speed.py: a 2.6 GB checkpoint hashes about five times faster than with SHA-256).
HASHES = {"sha256": hashlib.sha256, "blake3": blake3.blake3}
# read in pieces: a checkpoint file may be gigabytes
CHUNK_BYTES = 8 * 2**20


def feed(digest, path: Path) -> None:
    """Adds the bytes of the file at `path` to `digest` (a `HASHES` object), read in pieces: a
    running digest of several files (a corpus' content, for its cache key) or one file's."""
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            # both release the GIL: hashing runs beside other threads' work
            digest.update(chunk)


def file_facts(path: Path) -> list[int | None]:
    """`[size, modification time in ns, inode]` of the file at `path`; `[None]` where there is none."""
    try:
        facts = path.stat()
    except FileNotFoundError:
        return [None]
    return [facts.st_size, facts.st_mtime_ns, facts.st_ino]


def read_memo(memo: Path) -> dict:
    """The JSON object in the file `memo`; `{}` where it is missing, unreadable or not an object
    (a memo is a cache: what it lost is computed again)."""
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def remembered(memo: Path, paths: list[Path], compute: Callable[[], str]) -> str:
    """`compute()`, a digest of the files at `paths` (or a check's verdict on them), kept in the JSON
    file `memo` under the files' names, sizes, modification times and inodes (a missing file's
    absence too), and read back while none of them changes: a corpus of WMT14's size took 1.2 s to
    hash at every start. A `compute` that raises leaves nothing remembered. (A
    file rewritten to the same size within the clock's resolution would keep its old digest, as
    `make` would keep its target.)"""
    facts = [[str(path.resolve()), *file_facts(path)] for path in paths]
    key = hashlib.sha256(json.dumps(facts).encode()).hexdigest()
    known = read_memo(memo)
    if not isinstance(known.get(key), str):
        known[key] = compute()
        memo.parent.mkdir(parents=True, exist_ok=True)
        # processes writing it at once: the last one's survives, the others' are computed again
        write_whole(memo, lambda temporary: temporary.write_text(json.dumps(known)))
    return known[key]


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """The hex digest of the file at `path` by `algorithm` (a name of `HASHES`)."""
    digest = HASHES[algorithm]()
    feed(digest, path)
    return digest.hexdigest()


def sha256(path: Path) -> str:
    """The file's SHA-256, hex."""
    return file_digest(path, "sha256")


def file_digests(folder: Path, *, skip: Collection[str] = (), algorithm: str = "sha256") -> dict[str, str]:
    """`{relative path: digest}` of every file under `folder` but those at the relative paths `skip`
    (the digest file itself, say)."""
    return {
        str(path.relative_to(folder)): file_digest(path, algorithm)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and str(path.relative_to(folder)) not in skip
    }


def prune_least_recently_used(folder: Path, suffix: str, max_bytes: int, companions: Collection[str] = ()) -> int:
    """Deletes the least recently used files of `folder` whose names end in `suffix` until those left
    take at most `max_bytes`, each with its companions (the same name with `suffix` replaced by each
    of `companions`); returns the bytes freed. A file's use is the later of its access and
    modification times: reads move it where the file system records them (Linux's default
    `relatime`, to within a day), elsewhere the order is the writes'. A file that another process
    removed meanwhile is passed over."""
    entries = []
    for path in folder.glob(f"*{suffix}"):
        with contextlib.suppress(FileNotFoundError):
            facts = path.stat()
            entries.append((max(facts.st_atime_ns, facts.st_mtime_ns), facts.st_size, path))
    total, freed = sum(size for _, size, _ in entries), 0
    for _, size, path in sorted(entries):
        if total - freed <= max_bytes:
            break
        for name in (path.name, *(path.name.removesuffix(suffix) + companion for companion in companions)):
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()
        freed += size
    return freed


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Holds the lock file `path` (created with its folder), waiting for the process holding it:
    it serialises the processes of one machine (builds into one data_dir, opening one study)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # the kernel's flock: a killed holder leaves it free
    with filelock.FileLock(path, fallback_to_soft=False):
        yield


class WorkdirLock:
    """`workdir/.lock`, held by the run training there; `workdir/.lock.holder` names the holder (pid
    and host). A lock left by a killed run is free (the kernel released it) and simply taken over."""

    def __init__(self, lock: filelock.BaseFileLock):
        self.lock = lock

    @classmethod
    def acquire(cls, workdir: Path) -> WorkdirLock:
        """The lock of `workdir` (which exists), or `WorkdirInUse` naming the holder; waits for nothing."""
        # The kernel's flock or nothing (no soft lock a killed run would leave held); any thread may release it.
        lock = filelock.FileLock(workdir / ".lock", blocking=False, thread_local=False, fallback_to_soft=False)
        holder = workdir / ".lock.holder"
        try:
            lock.acquire()
        except filelock.Timeout:
            try:
                named = holder.read_text().strip()
            except OSError:
                named = ""
            raise WorkdirInUse(
                f"{workdir} is in use by another run ({named or 'an unknown process'}); "
                "wait for it to end, or train in another workdir"
            ) from None
        named = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n"
        write_whole(holder, lambda temporary: temporary.write_text(named))
        return cls(lock)

    def release(self) -> None:
        if self.lock.is_locked:
            self.lock.release()
