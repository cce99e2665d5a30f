"""Running train.py in tests: the tiny flags, a subprocess on them, its metrics rows, the state it saved,
and the states of two runs compared."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from engine import exported_step, training_loop
from helpers.tiny import xla_flags
from run_setup.run import prepare_run
from run_setup.settings import parse
from utils import metric_writer

PROJECT_ROOT = Path(__file__).resolve().parents[2]

TINY_FLAGS = [
    "--config.task.train_size=600",
    "--config.task.dev_size=24",
    "--config.task.test_size=24",
    "--config.model.d_model=16",
    "--config.model.num_heads=2",
    "--config.model.d_ff=32",
    "--config.model.num_encoder_layers=1",
    "--config.model.num_decoder_layers=1",
    "--config.batch_size=16",
    "--config.warmup_steps=5",
    "--config.log_every_steps=5",
    # matplotlib's import and a drawing, 0.5 s of a tiny run's 4 (tests/conftest.py's stub is in-process only)
    "--config.curves_png=false",
]


# train.py, killed or slowed by itself at a point the test chooses
FAULT_WORKER = PROJECT_ROOT / "tests" / "helpers" / "fault_worker.py"

# the whole run that the runs cut by a kill or a stop are compared with (the `whole_tiny_run` fixture)
WHOLE_RUN_FLAGS = [
    "--config.num_train_steps=60",
    "--config.checkpoint_every_steps=20",
    "--config.eval_every_steps=30",
    "--config.visualize_examples=0",
]


def run_train_py(
    workdir, data_dir, *flags, env=None, tiny=TINY_FLAGS, script=PROJECT_ROOT / "train.py", point=None, **popen
):
    """train.py (or `script`, given `point` first: tests/helpers/fault_worker.py) on the tiny config in a subprocess."""
    command = [
        sys.executable,
        str(script),
        *([point] if point else []),
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        *tiny,
        *flags,
    ]
    environment = {**os.environ, "XLA_FLAGS": xla_flags(1), **(env or {})}
    return subprocess.Popen(
        command, cwd=PROJECT_ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def metric_rows(workdir) -> list[dict]:
    """The run's metrics.jsonl rows, as the report page reads them."""
    return metric_writer.read_jsonl(Path(workdir))


def final_state(config, workdir, step):
    """The training state saved in `workdir` at `step`, restored onto one device."""
    run = prepare_run(parse(config), workdir, devices=jax.devices()[:1], with_data=False)
    try:
        return run.checkpoints.restore(
            run.abstract(training_loop.initial_state(run, training_loop.make_optimizer(run.settings.optimization))),
            step=step,
        )[1]
    finally:
        run.checkpoints.close()


def assert_same_final_state(config, whole_dir, cut_dir, step):
    whole_state, cut_state = final_state(config, whole_dir, step), final_state(config, cut_dir, step)
    for a, b in zip(jax.tree.leaves(whole_state), jax.tree.leaves(cut_state), strict=True):
        # bit-identical
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return whole_state


def wrap_train_steps(wrap, install=setattr) -> None:
    """Makes the training loop run `wrap(step_function)` in place of each train step it runs (the
    exported one, `engine.exported_step.cached`, or the jitted one where nothing is kept).
    `install(exported_step, "cached", wrapper)` puts it in place: `setattr` in a process of its own
    (helpers/fault_worker.py), a test's `monkeypatch.setattr` in the tests' process (undone after it)."""
    cached = exported_step.cached

    def wrapped_step(*args, **kwargs):
        step_function = cached(*args, **kwargs)
        wrapped = wrap(step_function)
        # the loop compiles the first step ahead of its call
        if not hasattr(wrapped, "lower"):
            wrapped.lower = step_function.lower
        return wrapped

    install(exported_step, "cached", wrapped_step)
