"""Entry point: `python train.py --config=configs/NAME.py --workdir=DIR [--config.a.b=v ...] [--mode=...]`.

With no flags it trains `configs/default.py` (the embedded default task) into a
fresh `runs/default-<time>` folder. Re-running the same command on the same
workdir resumes from its latest checkpoint (a changed model, task, tokenizer,
data or seed field is refused). `--mode=eval` and `--mode=predict` read the
run's own `DIR/config.json`, with evaluation fields (`eval_split`,
`restore_step`, `restore_best`, `average_last`, `decode.*`, ...) overridable,
restore a checkpoint and never train; they decode the whole split unless
`--config.eval_decode_examples` is given.

`--config=FILE.py:ARG` calls the file's `get_config(ARG)` (e.g. `configs/wmt14_transformer.py:big`);
`--flagfile=FILE` reads flags, overrides among them, from FILE, one a line.
Overrides are `--config.a.b=value` (also `--config.task.name=...` and
`--config.model.name=...`, which switch the task or the model family and its
fields). Logs go to the console and to `DIR/log.txt`; absl's `--verbosity`
and `--stderrthreshold` work.
"""

from __future__ import annotations

# first: glibc reads its tunables at process start, before any thread exists
if __name__ == "__main__":
    from utils import allocator

    allocator.restart_with_huge_pages(__file__)
    allocator.collect_less_while_importing()

import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

import inference  # noqa: E402
from configs import base  # noqa: E402
from engine import (
    evaluation,  # noqa: E402
    training_loop,  # noqa: E402
)
from run_setup import (  # noqa: E402
    command_line,
    compatibility,
    settings,  # noqa: E402
)
from utils import allocator, files, stop_signals  # noqa: E402
from utils.errors import ConfigError, UserError  # noqa: E402

PROJECT_ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "default.py"
# unless JAX_COMPILATION_CACHE_DIR names another
COMPILATION_CACHE = Path.home() / ".cache" / "attend" / "jax"
COMPILATION_CACHE_BYTES = 2 * 2**30
# The libraries' warnings that tell a run nothing it can act on, by their format strings (absl's logger):
# Orbax's at every checkpoint saved between evaluations (run_setup/checkpoints.py saves those without
# metrics on purpose: only an evaluated checkpoint is a candidate for the best), and TFDS's at every
# start (each task makes its builder's config from its own fields; none is one of TFDS's predefined).
UNACTIONABLE_LIBRARY_WARNINGS = frozenset(
    {"Requested `tracked_metric`; did not provide metrics.", "Using custom data configuration: %s"}
)

flags.DEFINE_string(
    "config", str(DEFAULT_CONFIG), "Experiment config file (eval/predict: default the run's config.json)."
)
flags.DEFINE_string("workdir", None, "Run folder (default: a fresh runs/<config>-<time>).")
flags.DEFINE_enum("mode", "train", ["train", "eval", "predict"], "What to do.")
flags.DEFINE_string(
    "input_file", None, "--mode=predict: decode these lines (one source each; - = standard input) instead of a split."
)
FLAGS = flags.FLAGS
# the --config.a.b=value arguments, taken out before absl parses the rest
OVERRIDES: list[str] = []


def one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def exit_with_error(error: BaseException) -> None:
    """A user error in one line on stderr, exit code 2."""
    print(f"error: {one_line(error)}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing of the flags; the `--config.*` overrides, also those of a `--flagfile`, go to
    `configs.base.load` instead."""
    try:
        arguments, overrides = command_line.split_overrides(argv, FLAGS)
        OVERRIDES.extend(overrides)
        return FLAGS(arguments)
    except flags.Error as error:
        exit_with_error(error)


def default_workdir() -> Path:
    """runs/<config file's name>[-<its argument>]-<time>."""
    path, argument = base.split_config_argument(FLAGS.config)
    return PROJECT_ROOT / "runs" / f"{'-'.join(filter(None, (path.stem, argument)))}-{time.strftime('%Y%m%d-%H%M%S')}"


def settings_for(mode: str, workdir: Path, config_file: str | None, overrides: list[str]) -> settings.Settings:
    """Training: the config file with the `--config.a.b=value` overrides, parsed. Eval and predict:
    the run's config.json with the evaluation fields of the overrides (or of `config_file`, when
    one is given)."""
    if mode == "train":
        return settings.parse(base.load(config_file, overrides))
    saved = base.read_run_config(workdir)
    if saved is None:
        raise ConfigError(f"--mode={mode} needs a run folder, and {workdir} holds no config.json")
    requested = base.load(config_file or saved, overrides)
    overridden = [arg.removeprefix("--config.").split("=", 1)[0] for arg in overrides]
    return compatibility.for_evaluation(settings.parse(saved), settings.parse(requested), overridden)


def run_mode(run_settings: settings.Settings, workdir: Path):
    if FLAGS.mode == "train":
        return training_loop.train_and_evaluate(run_settings, workdir)
    if FLAGS.mode == "eval":
        return evaluation.evaluate(run_settings, workdir)
    if FLAGS.input_file:
        return inference.translate_file(run_settings, workdir, FLAGS.input_file)
    return evaluation.predict(run_settings, workdir)


def set_up_process(quiet: bool = True) -> None:
    """What every training process sets before JAX's backend starts (the benchmarks too); `quiet`: the
    libraries' INFO lines (Orbax and TFDS log through absl's logger) and their warnings that a run
    cannot act on kept off the console (train.py shows them with --verbosity=1)."""
    if quiet:
        for library in ("absl", "jax", "orbax", "grain", "tensorflow_datasets"):
            logging.getLogger(library).setLevel(logging.WARNING)
        # (a record's msg may be any object, an unhashable one too)
        logging.getLogger("absl").addFilter(lambda record: str(record.msg) not in UNACTIONABLE_LIBRARY_WARNINGS)
    # shown in the start-up summary (a bad flag's error stays the only line on stderr)
    allocator.set_up()
    # the next run loads its programs instead of compiling them
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(COMPILATION_CACHE))
        # the least recently used go, here, once a process: JAX's own cap (`jax_compilation_cache_max_size`)
        # lists the folder and reads every entry's access time at each program it writes, 17 ms a program
        # with 500 entries and 172 ms with 5,000 (docs/performance.md, "The compilation cache")
        if COMPILATION_CACHE.is_dir():
            files.prune_least_recently_used(COMPILATION_CACHE, "-cache", COMPILATION_CACHE_BYTES, companions=["-atime"])
    # every program kept, the small ones too (JAX keeps only those that took a second to compile): made
    # op by op, the kjv_web_transformer's model took 1.7 s to create, 0.4 s with its programs loaded
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    set_up_process(quiet=FLAGS.verbosity < 1)
    workdir = Path(FLAGS.workdir) if FLAGS.workdir else default_workdir()
    try:
        # SIGTERM/SIGINT stop every phase within seconds (utils/stop_signals.py)
        with stop_signals.handled():
            # --config counts for eval and predict only where given: they read the run's own config.json
            config_file = FLAGS.config if FLAGS.mode == "train" or FLAGS["config"].present else None
            result = run_mode(settings_for(FLAGS.mode, workdir, config_file, OVERRIDES), workdir)
    except UserError as error:
        # the message names the culprit; anything else is a bug and keeps its traceback
        exit_with_error(error)
    except stop_signals.Stopped as stopped:
        # one line saying what was kept; 128 + the signal's number, as a shell reports a process it stopped
        print(stopped.line(), file=sys.stderr, flush=True)
        return stopped.exit_code
    if FLAGS.mode == "eval":
        print({k: v for k, v in result.items() if not k.endswith("signature")})
    elif FLAGS.mode == "predict":
        print(f"predictions: {result}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)
