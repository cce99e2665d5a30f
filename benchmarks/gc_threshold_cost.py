"""Python's garbage collector during tracing: at its default thresholds against
`allocator.collect_garbage_less_often`.

    python benchmarks/gc_threshold_cost.py [--runs 6]

Trains configs/default.py's Transformer shrunk to seconds (`small_config`: 20 steps of 16
examples, two evaluations, one device) `--runs` times in one process, alternating the collector's settings run by
run: each run traces and lowers its programs again (the compiled ones come from the
in-memory cache after the first), as a test suite or a sweep of runs in one process
does. Prints, per setting, the median seconds of a run and of the collector's
passes within it (timed by `gc.callbacks`), and the full collections a run made.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

from configs import base, default  # noqa: E402
from engine import training_loop  # noqa: E402
from run_setup.settings import parse  # noqa: E402
from utils import allocator  # noqa: E402

flags.DEFINE_integer("runs", 6, "tiny runs, alternating the two settings")
FLAGS = flags.FLAGS
DEFAULTS = (700, 10, 10)


def small_config(data_dir: Path):
    config = default.get_config()
    config.data_dir = str(data_dir)
    overrides = {
        "task.train_size": 600,
        "task.dev_size": 24,
        "task.test_size": 24,
        "model.d_model": 16,
        "model.num_heads": 2,
        "model.d_ff": 32,
        "model.num_encoder_layers": 1,
        "model.num_decoder_layers": 1,
        "batch_size": 16,
        "num_train_steps": 20,
        "eval_every_steps": 10,
        "checkpoint_every_steps": 10,
        "warmup_steps": 5,
        "visualize_examples": 0,
    }
    for name, value in overrides.items():
        base.set_field(config, name, value)
    return config


class CollectorClock:
    """Seconds spent in the collector's passes and full collections, from `gc.callbacks`."""

    def __init__(self):
        self.seconds, self.full, self._started = 0.0, 0, 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.full += info["generation"] == 2


def main(argv: list[str]) -> None:
    del argv
    for library in ("absl", "jax", "orbax", "grain", "tensorflow_datasets"):
        logging.getLogger(library).setLevel(logging.WARNING)
    clock = CollectorClock()
    measured = {"defaults": [], "tuned": []}
    with tempfile.TemporaryDirectory() as temporary:
        data_dir = Path(temporary) / "tfds"
        # the first run builds the data and compiles: not counted
        for number in range(FLAGS.runs + 1):
            setting = "tuned" if number % 2 else "defaults"
            gc.unfreeze()
            if setting == "tuned":
                allocator.collect_garbage_less_often()
            else:
                gc.collect()
                gc.set_threshold(*DEFAULTS)
            clock.seconds, clock.full = 0.0, 0
            start = time.perf_counter()
            training_loop.train_and_evaluate(parse(small_config(data_dir)), Path(temporary) / f"run_{number}")
            if number:
                measured[setting].append((time.perf_counter() - start, clock.seconds, clock.full))
    print("| collector | thresholds | run s | collector s | full collections |")
    print("|---|---|---:|---:|---:|")
    for setting, thresholds in (("defaults", DEFAULTS), ("tuned", allocator.GC_THRESHOLDS)):
        runs = measured[setting]
        print(
            f"| {setting} | {thresholds} | {statistics.median(r[0] for r in runs):.2f} "
            f"| {statistics.median(r[1] for r in runs):.2f} "
            f"| {statistics.median(r[2] for r in runs):g} |"
        )


if __name__ == "__main__":
    app.run(main)
