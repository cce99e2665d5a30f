"""How a long-running command stops on request (SIGTERM, or SIGINT from Ctrl-C) within the 30 s
that schedulers grant before they kill (SLURM's `KillWait`, Kubernetes' grace period).

`handled()` installs the handlers (train.py and the sweep's processes; nested uses share them).
What the first signal does depends on where it lands:

- **where the work can stop at once** (the default: building data, training a vocabulary,
  tokenizing, compiling the first step, evaluating, decoding) it raises `Stopped` in the main
  thread: the writers keep whole files only (`files.write_whole` removes its temporary), and the
  same command starts the phase again;
- **where stopping at once would lose work** (inside `deferred()`: the train steps and the
  checkpoint writes) it sets `requested()`, which the training loop reads after each step: it
  saves, then stops.

A watcher thread, woken through `signal.set_wakeup_fd` (so also while the main thread is inside
XLA's compiler or SentencePiece's trainer, which release the GIL but run no Python handler until
they return), ends the process at once on a second signal (a second or more after the first: sooner, it is the
same stop delivered twice), and `LIMIT_SECONDS` after the first if
it is still running (25, or `ATTEND_STOP_LIMIT_SECONDS` where a scheduler grants another grace
period); it first removes the temporaries of writes under way and stops the child processes (a
pool's workers), then prints one line.

`ATTEND_SIGNAL_AT=PHASE[@SECONDS][xCOUNT]` (a test hook) makes the process send itself SIGTERM
`SECONDS` after it enters the first phase whose name starts with PHASE (`phase()`), COUNT times,
from another thread; without SECONDS, a phase where signals are deferred waits until the first is sent.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import select
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# SLURM, Kubernetes and the cloud VMs kill 30 s after SIGTERM: ours is sooner, so that the line
# saying what was kept is printed
LIMIT_SECONDS = float(os.environ.get("ATTEND_STOP_LIMIT_SECONDS", 25.0))
TEST_HOOK = "ATTEND_SIGNAL_AT"
# a second signal sooner than this after the first is the same stop, delivered twice
SAME_STOP_SECONDS = 1.0


class Stopped(BaseException):
    """A stop signal where the work stops at once (a BaseException, as KeyboardInterrupt is: an
    `except Exception` on the way up does not swallow it). `kept` says what was saved."""

    def __init__(self, signum: int, where: str, kept: str = ""):
        self.signum, self.where, self.kept = signum, where, kept
        super().__init__(self.line())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        kept = self.kept or "whole files only (nothing of that phase)"
        return (
            f"stopped by {signal.Signals(self.signum).name} while {self.where}: kept {kept}; the same command goes on"
        )


class _State:
    def __init__(self):
        self.installed = 0
        self.signum: int | None = None
        # signals received: the watcher counts the second
        self.count = 0
        # the first signal as the watcher read it
        self.watched: int | None = None
        self.deferring = 0
        self.phase = "setting up"
        # the phase the first signal came in
        self.where = ""
        self.on_signal: list[Callable[[int], None]] = []
        self.temporaries: set[str] = set()


_state = _State()


def requested() -> bool:
    """A stop signal came (the training loop saves after its step, then stops)."""
    return _state.signum is not None


def request(signum: int = signal.SIGTERM) -> None:
    """A stop decided elsewhere (several processes: JAX's preemption notice)."""
    if _state.signum is None:
        _state.signum, _state.where = signum, _state.phase


def signum() -> int:
    return _state.signum or _state.watched or signal.SIGTERM


def count() -> int:
    """The stop signals received so far (a second one ends the process: `on_signal` hears it first)."""
    return _state.count


def where() -> str:
    """The phase the first signal came in."""
    return _state.where or _state.phase


def check() -> None:
    """Raises `Stopped` where a signal came during a `deferred()` part of stoppable work (a file
    and its metrics row written together)."""
    if requested() and not _state.deferring:
        raise Stopped(signum(), where())


@contextlib.contextmanager
def handled(*, on_signal: Callable[[int], None] | None = None, limit: float | None = None) -> Iterator[None]:
    """Installs the handlers and the watcher for the block (see the module docstring); `on_signal(signum)`
    is called on each signal (a sweep passes it on to its workers). Outside the main thread, where
    Python cannot install handlers, it installs none."""
    if on_signal is not None:
        _state.on_signal.append(on_signal)
    if _state.installed or threading.current_thread() is not threading.main_thread():
        _state.installed += bool(_state.installed)
        try:
            yield
        finally:
            _state.installed -= bool(_state.installed)
            if on_signal is not None:
                _state.on_signal.remove(on_signal)
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = {signum: signal.signal(signum, _handle) for signum in _signals_to_handle()}
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    _state.installed, _state.signum, _state.count, _state.watched = 1, None, 0, None
    watcher = threading.Thread(
        target=_watch,
        args=(read_end, LIMIT_SECONDS if limit is None else limit),
        name="attend-stop-watcher",
        daemon=True,
    )
    watcher.start()
    try:
        yield
    finally:
        _state.installed = 0
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            # stopping already: another signal ends the process at once, quietly
            signal.signal(signum, _exit_quietly if requested() else handler)
        # wakes the watcher, which leaves
        os.close(write_end)
        watcher.join()
        os.close(read_end)
        if on_signal is not None:
            _state.on_signal.remove(on_signal)


def _signals_to_handle() -> tuple[int, ...]:
    """Both, but SIGTERM where JAX's distributed runtime is up already: with several processes, SIGTERM
    is its preemption notice (its own handler), which the processes agree on (engine/training_loop.py).
    Installed before the runtime starts (train.py), ours gives way to JAX's."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        return (signal.SIGINT,)
    return SIGNALS


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal only sets `requested()` in this block: the caller stops where nothing is lost."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A block that a signal does not cut (files written together): in stoppable work, a signal that
    came during it stops the work once the block is done."""
    with deferred():
        yield
    check()


@contextlib.contextmanager
def abortable(where: str) -> Iterator[None]:
    """Inside a `deferred()` block, a part that a signal stops at once (`Stopped`): an evaluation.
    A signal that came before it stops it before it starts. (The handler raises `Stopped` in whatever
    runs when the signal comes, which may be library code that swallows it: JAX's tracing has bare
    `except:` clauses. The work then ends as if the signal came after it: see the first train step.)"""
    saved, _state.deferring = _state.deferring, 0
    try:
        with phase(where):
            check()
            yield
    finally:
        _state.deferring = saved


@contextlib.contextmanager
def phase(where: str) -> Iterator[None]:
    """Names the work under way (`progress.phase` calls it) for the messages; the test hook's place."""
    saved, _state.phase = _state.phase, where
    try:
        _place_test_signal(where)
        yield
    finally:
        _state.phase = saved


@contextlib.contextmanager
def temporary(path: str | os.PathLike) -> Iterator[None]:
    """`path` is removed if the process is ended at once while the block runs (`files.write_whole`)."""
    _state.temporaries.add(os.fspath(path))
    try:
        yield
    finally:
        _state.temporaries.discard(os.fspath(path))


@contextlib.contextmanager
def children_leave_ctrl_c_to_us() -> Iterator[None]:
    """Child processes started in the block (a pool's workers) ignore SIGINT, which a terminal's Ctrl-C
    sends to the whole process group: it is this process's to handle (it stops the pool, whose
    SIGTERM ends them). They inherit the ignored signal through `exec` from their first instruction
    (a worker still importing would print KeyboardInterrupt's traceback), and Python leaves it
    ignored. A Ctrl-C in the block itself (the milliseconds of starting them) is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _handle(signum: int, frame) -> None:
    """The first signal: recorded, passed on, and `Stopped` raised unless deferred. No I/O here: the
    handler runs between two bytecodes of the main thread, which may be inside a write to the same
    file (a log line), and a nested write raises; the line saying what was kept comes at the exit."""
    if _state.signum is not None:
        # the second: the watcher passes it on and ends the process
        return
    _state.signum, _state.where, _state.count = signum, _state.phase, 1
    for call in list(_state.on_signal):
        call(signum)
    if not _state.deferring:
        raise Stopped(signum, _state.phase)


def _exit_quietly(signum: int, frame) -> None:
    os._exit(128 + signum)


def _watch(read_end: int, limit: float) -> None:
    """The watcher thread: a second signal, or the first one's limit passed, ends the process."""
    first_at, count = None, 0
    while True:
        timeout = None if first_at is None else max(first_at + limit - time.monotonic(), 0.0)
        ready, _, _ = select.select([read_end], [], [], timeout)
        if ready:
            data = os.read(read_end, 64)
            if not data:
                # handled() ended
                return
            for byte in data:
                # the handlers' signals only (the fd is ours)
                if byte not in SIGNALS:
                    continue
                if first_at is None:
                    first_at, count = time.monotonic(), 1
                    # for the exit code, where the handler has not run yet (the main thread in compiled code)
                    _state.watched = byte
                # within SAME_STOP_SECONDS: the same stop delivered twice (a scheduler signals every
                # process of a job, and sweep.py and its workers pass it on as well)
                elif time.monotonic() - first_at >= SAME_STOP_SECONDS:
                    count = 2
            if count >= 2:
                _state.count = 2
                for call in list(_state.on_signal):
                    call(signum())
                _exit_now(f"a second {signal.Signals(signum()).name}: exiting at once")
        elif first_at is not None and _state.installed:
            _exit_now(f"still {_state.phase} {limit:g} s after {signal.Signals(signum()).name}: exiting")


def _exit_now(why: str) -> None:
    """Ends the process from the watcher: temporaries removed, child processes stopped, one line."""
    for path in list(_state.temporaries):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError):
            child.kill()
    print(
        f"stopped: {why}; kept the last checkpoint and whole files only; the same command goes on",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signum())


def _place_test_signal(where: str) -> None:
    """The test hook (module docstring): signals this process once it is in the phase named."""
    wanted = os.environ.get(TEST_HOOK)
    if not wanted:
        return
    name, delay, count = re.fullmatch(r"(.*?)(?:@([\d.]+))?(?:x(\d+))?", wanted).groups()
    if not where.startswith(name):
        return
    # once per process
    os.environ.pop(TEST_HOOK)

    sent = threading.Event()

    def send() -> None:
        for _ in range(int(count or 1)):
            # what the test measures from
            print(f"test hook: SIGTERM at {time.time():.3f} while {where}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            sent.set()
            # two signals sent at once would merge into one
            time.sleep(0.05)

    # from another thread, as a scheduler's signal comes: the handler runs in the main thread
    threading.Timer(float(delay or 0), send).start()
    if not delay and _state.deferring:
        # where a signal is only noted (a train step, a save), the phase goes on once it is sent: a
        # thread started late on a loaded machine would let a tiny run's steps (milliseconds) pass
        # the step the test names. Where it stops the work at once, it lands mid-work as a
        # scheduler's would.
        sent.wait(timeout=30)
