"""Entry point: `python train.py --config=configs/NAME.py --workdir=DIR [--config.a.b=v ...] [--mode=...]`.

With no flags it trains `configs/default.py` (the embedded default task) into a
fresh `runs/default-<time>` folder. Re-running the same command on the same
workdir resumes from its latest checkpoint. `--mode=eval` and `--mode=predict`
restore a checkpoint (the latest, `--config.restore_step=N`, or the best with
`--config.restore_best=true`) and never train.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

import evaluation
import inference
import trainer
from errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parent


def one_line(error: BaseException) -> str:
    text = error.args[0] if isinstance(error, KeyError) and error.args else error  # KeyError's str() is a repr
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip()) or type(error).__name__


def exit_with_flag_error(error: BaseException) -> None:
    """One line for a bad flag or config: the outer message (it names the culprit) and its root cause."""
    root = error
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    message, cause = one_line(error), one_line(root)
    print(f"error: {message}" + ("" if cause in message else f" ({cause})"), file=sys.stderr)
    sys.exit(2)


try:  # ml_collections reads the --config.* overrides of sys.argv here, at definition
    config_flags.DEFINE_config_file(
        "config", str(PROJECT_ROOT / "configs" / "default.py"), "Experiment config file.", lock_config=True
    )
except Exception as error:
    exit_with_flag_error(error)
flags.DEFINE_string("workdir", None, "Run folder (default: a fresh runs/<config>-<time>).")
flags.DEFINE_enum("mode", "train", ["train", "eval", "predict"], "What to do.")
flags.DEFINE_string("input_file", None, "--mode=predict: decode these lines (one source each; - = standard input) instead of a split.")
FLAGS = flags.FLAGS



def default_workdir() -> Path:
    name = Path(config_flags.get_config_filename(FLAGS["config"])).stem
    return PROJECT_ROOT / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_mode(config, workdir: Path):
    if FLAGS.mode == "train":
        return trainer.train_and_evaluate(config, workdir)
    if FLAGS.mode == "eval":
        return evaluation.evaluate(config, workdir)
    if FLAGS.input_file:
        return inference.translate_file(config, workdir, FLAGS.input_file)
    return evaluation.predict(config, workdir)


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.getLogger().setLevel(logging.WARNING)
    try:
        config = FLAGS.config  # the config file is loaded here, on first access: anything raised is about it
    except Exception as error:
        exit_with_flag_error(error)
    workdir = Path(FLAGS.workdir) if FLAGS.workdir else default_workdir()
    try:
        result = run_mode(config, workdir)
    except UserError as error:  # the message names the culprit; anything else is a bug and keeps its traceback
        exit_with_flag_error(error)
    if FLAGS.mode == "eval":
        print({k: v for k, v in result.items() if not k.endswith("signature")})
    elif FLAGS.mode == "predict":
        print(f"predictions: {result}")
    return 0


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with a bad `--config...` (unknown key, wrong type) reported in one line."""
    try:
        return FLAGS(argv)
    except Exception as error:  # anything raised while parsing flags is about the flags
        exit_with_flag_error(error)


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)
