"""train.py, killed (SIGKILL) by itself at a point the test chooses (tests/test_crash_recovery.py), or
with slowed steps (tests/test_stopping.py).

    python tests/helpers/fault_worker.py POINT TRAIN_PY_FLAGS...

POINT is `step:N` (while train step N runs; N=1 is the first step, before anything is saved),
`save:N` (inside the save of step N: its files written, Orbax's commit not yet done), `eval`
(inside the first evaluation of this process, while it decodes), `slow:SECONDS` (nothing killed:
each train step waits SECONDS on the device's side, dispatched as a real step of seconds is) or
`swallowed` (SIGTERM while the first step compiles, its `Stopped` swallowed by the code it lands in).

At the kill points saves are synchronous, so that what a kill leaves behind does not depend on the
machine's speed: an asynchronous save may or may not be committed when a later point is reached.
With slowed steps they are train.py's own, asynchronous.
"""

import os
import signal
import sys
import time
from pathlib import Path

# The project's root (its modules) and tests/ (the helpers package) on the path, as pytest has them.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from utils import allocator  # noqa: E402

allocator.collect_less_while_importing()

import jax  # noqa: E402
from absl import app  # noqa: E402
from orbax.checkpoint._src.path import atomicity  # noqa: E402

import train  # noqa: E402
from engine import evaluation  # noqa: E402
from helpers.subprocess_runs import wrap_train_steps  # noqa: E402
from run_setup import checkpoints  # noqa: E402


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def signal_at_step(number: int, signum: int, pause_after: float = 0.0) -> None:
    """Makes this process send itself `signum` while train step `number` runs, then pause
    `pause_after` seconds in each later step (see helpers/two_process_worker.py)."""

    def signalling(step_function):
        def signalling_step(state, batch):
            step = int(jax.device_get(state["step"])) + 1
            # dispatched: the step is under way
            outputs = step_function(state, batch)
            if step == number:
                os.kill(os.getpid(), signum)
            elif step > number:
                time.sleep(pause_after)
            return outputs

        return signalling_step

    wrap_train_steps(signalling)


def slow_steps(seconds: float) -> None:
    """Makes each train step wait `seconds` on the device's side: a callback its input depends on.
    The step is dispatched asynchronously, as a real step of seconds is, so the loop is free to run
    ahead of it."""

    def sleep_then(value):
        time.sleep(seconds)
        return value

    wait = jax.jit(lambda x: jax.pure_callback(sleep_then, jax.ShapeDtypeStruct(x.shape, x.dtype), x))

    def slowed(step_function):
        return lambda state, batch: step_function({**state, "step": wait(state["step"])}, batch)

    wrap_train_steps(slowed)


def stop_swallowed_while_compiling() -> None:
    """SIGTERM while the first step is lowered, its `Stopped` swallowed there as one of JAX's bare
    `except:` clauses would swallow it (the handler raises in whatever code runs)."""

    def swallowing(step_function):
        def lower(*args, **kwargs):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except BaseException:
                pass
            return step_function.lower(*args, **kwargs)

        def step(state, batch):
            return step_function(state, batch)

        step.lower = lower
        return step

    wrap_train_steps(swallowing)


def kill_inside_save(number: str) -> None:
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def killing_finalize(self):
        if self._final_path.name == number:
            die()
        return await finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize


def synchronous_saves() -> None:
    make_checkpoints = checkpoints.Checkpoints.__init__

    def make_synchronous(self, *args, **kwargs):
        make_checkpoints(self, *args, **{**kwargs, "async_save": False})

    checkpoints.Checkpoints.__init__ = make_synchronous


if __name__ == "__main__":
    point, flags = sys.argv[1], sys.argv[2:]
    kind, _, number = point.partition(":")
    if kind not in ("slow", "swallowed"):
        synchronous_saves()
    if kind == "step":
        signal_at_step(int(number), signal.SIGKILL)
    elif kind == "save":
        kill_inside_save(number)
    elif kind == "eval":
        evaluation.Evaluator.hypotheses = lambda *args, **kwargs: die()
    elif kind == "slow":
        slow_steps(float(number))
    elif kind == "swallowed":
        stop_swallowed_while_compiling()
    else:
        raise SystemExit(f"unknown point {point}")
    sys.argv = [str(Path(train.__file__)), *flags]
    app.run(lambda argv: sys.exit(train.main(argv)), flags_parser=train.parse_flags)
