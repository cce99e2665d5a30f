"""The length experiment of Bahdanau et al. (2015), figure 2: quality against source length.

    python benchmarks/length_experiment.py --workdir=runs/length                 # copy, sources of 5-100
    python benchmarks/length_experiment.py --workdir=runs/length_kjv --task=kjv_web --steps=20000
    python benchmarks/length_experiment.py --workdir=runs/length --steps=2000 --families=lstmn --lstmn_variants=all

Trains RNNencdec, RNNsearch, LSTMN and the Transformer under one budget (the same
steps, batch of 64 examples bucketed by length, warmup and cosine schedule;
each family keeps its own learning rate), decodes the whole test split
greedily, and scores it per bucket of source length: on `copy` (random
strings of 5 to 100 symbols) exact match and symbol accuracy, on `kjv_web`
BLEU. Prints a markdown table and writes `WORKDIR/length_experiment.png`.
The fixed-length summary of RNNencdec should fall as sources grow while
RNNsearch stays flat.

`--lstmn_variants` (a comma-separated list of `LSTMN_VARIANTS`' names, or `all`) trains one
LSTMN per variant under the same budget: shallow fusion with Bahdanau's query (`shallow_state`,
eq. 11' of arXiv:1601.06733v7, the model's default) or eq. 11's, the previous word and context
(`shallow_word_context`), deep fusion (`deep`, eq. 11), each with the paper's empty tapes or, with
`_seeded`, the authors' code's seeded ones (`models/lstmn.py` says which is which). Each is a
column `lstmn_<variant>` with its run folder `WORKDIR/lstmn_<variant>`.

A column whose run folder `WORKDIR/<column>` already holds a finished run is
not trained again (delete the folder to retrain). The figures measured with it:
docs/performance.md.
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys
from pathlib import Path

import ml_collections

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from configs import base, default, recurrent  # noqa: E402
from engine import (
    evaluation,  # noqa: E402
    training_loop,  # noqa: E402
)
from report import pictures  # noqa: E402
from run_setup import command_line, compatibility  # noqa: E402
from run_setup.settings import parse  # noqa: E402

FAMILIES = ("rnnencdec", "rnnsearch", "lstmn", "transformer")
# LSTMN's variants: model fields over the family's config (section 4's queries; the tapes' first state)
LSTMN_QUERIES = {
    # eq. 11', Bahdanau's query: the default
    "shallow_state": dict(fusion="shallow", inter_query="previous_state"),
    # eq. 11's
    "shallow_word_context": dict(fusion="shallow", inter_query="word_and_context"),
    "deep": dict(fusion="deep", inter_query="word_and_context"),
}
LSTMN_VARIANTS = {
    f"{name}{suffix}": dict(fields, seed_tapes=bool(suffix))
    for suffix in ("", "_seeded")
    for name, fields in LSTMN_QUERIES.items()
}
MAX_SOURCE = 100
STYLES = [
    dict(marker="o", linestyle="-", markersize=7),
    dict(marker="s", linestyle="--", markersize=9, fillstyle="none"),
    dict(marker="D", linestyle="-.", markersize=6, fillstyle="none"),
    dict(marker="^", linestyle=":", markersize=5),
]


def experiment_config(family: str, task: str, steps: int, data_dir: str, model_fields: dict | None = None):
    """The family's config for `task` with the shared budget; `model_fields` replace the family's (an
    LSTMN variant's)."""
    if task == "copy":
        config = recurrent.get_config(family, "reverse") if family != "transformer" else default.get_config()
        config.task = base.task("copy", min_length=5, max_length=MAX_SOURCE, vocab_size=20)
        # eos
        config.data.max_source_length = config.data.max_target_length = MAX_SOURCE + 1
        config.data.bucket_boundaries = (16, 32, 48, 64, 80, MAX_SOURCE + 1)
        config.best_metric = "exact_match"
        config.learning_rate = 2e-3 if family == "transformer" else 3e-3
    elif task == "kjv_web":
        name = "kjv_web_transformer" if family == "transformer" else f"{family}_kjv_web"
        config = importlib.import_module(f"configs.{name}").get_config()
        config.decode.beam_size = 1
    else:
        raise ValueError(f"--task must be copy or kjv_web, got {task!r}")
    config.model.update(model_fields or {})
    # the tapes hold the longest source, or the longest output decoded
    if family == "lstmn":
        config.model.max_length = config.data.max_source_length + config.decode.max_length_offset
    config.data_dir = data_dir
    config.num_train_steps = steps
    config.batch_size = 64
    # the same examples per step for every family
    config.data.batching = "bucket"
    config.warmup_steps = min(200, steps // 10)
    config.schedule = "cosine"
    config.eval_every_steps = config.checkpoint_every_steps = steps
    # the full test split is decoded by predict() below
    config.eval_decode_examples = 100
    config.visualize_examples = 0
    config.length_bucket_width = 10
    config.lock()
    return config


def train_and_score(config, workdir: Path) -> dict:
    """Trains (unless finished), then decodes the test split: `{bucket: {metric: value}}`."""
    finished = workdir / "eval" / f"step_{config.num_train_steps}.json"
    if not (finished.exists() and "by_source_length" in json.loads(finished.read_text()).get("test", {})):
        training_loop.train_and_evaluate(parse(config), workdir)
        whole_split = ml_collections.ConfigDict(config.to_dict())
        # training evaluated a subset; the table scores every example
        whole_split.eval_decode_examples = 0
        evaluation.predict(compatibility.as_the_run_began(parse(whole_split), workdir), workdir)
    return json.loads(finished.read_text())["test"]["by_source_length"]


def bucket_start(bucket: str) -> int:
    return int(bucket.split("-")[0])


def columns(families: list[str], lstmn_variants: str) -> dict[str, tuple[str, dict]]:
    """`{column: (family, model fields)}`: each family once, LSTMN once per variant asked for."""
    names = list(LSTMN_VARIANTS) if lstmn_variants == "all" else lstmn_variants.split(",")
    unknown = [name for name in names if name not in LSTMN_VARIANTS]
    if unknown:
        raise SystemExit(f"--lstmn_variants: unknown {', '.join(unknown)}; valid: all, {', '.join(LSTMN_VARIANTS)}")
    unknown = [family for family in families if family not in FAMILIES]
    if unknown:
        raise SystemExit(f"--families: unknown {', '.join(unknown)}; valid: {', '.join(FAMILIES)}")
    result = {}
    for family in families:
        if family == "lstmn":
            result.update({f"lstmn_{name}": ("lstmn", LSTMN_VARIANTS[name]) for name in names})
        else:
            result[family] = (family, {})
    return result


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", "runs/length_experiment", "", flag_values=FLAGS)
flags.DEFINE_enum("task", "copy", ("copy", "kjv_web"), "", flag_values=FLAGS)
flags.DEFINE_integer("steps", 3000, "", flag_values=FLAGS)
flags.DEFINE_string("data_dir", "data/tfds", "", flag_values=FLAGS)
flags.DEFINE_string("families", ",".join(FAMILIES), "", flag_values=FLAGS)
flags.DEFINE_string(
    "lstmn_variants", "shallow_state", f"comma-separated, or all: {', '.join(LSTMN_VARIANTS)}", flag_values=FLAGS
)


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    args = FLAGS
    workdir = Path(args.workdir)
    runs = columns(args.families.split(","), args.lstmn_variants)
    # the table's and the plot's columns
    families = list(runs)
    metrics = ("exact_match", "symbol_accuracy") if args.task == "copy" else ("bleu",)
    results = {
        column: train_and_score(
            experiment_config(family, args.task, args.steps, args.data_dir, fields), workdir / column
        )
        for column, (family, fields) in runs.items()
    }
    buckets = sorted({b for scores in results.values() for b in scores}, key=bucket_start)

    print(f"task {args.task}, {args.steps} steps of 64 examples per family; greedy decoding of the test split")
    print("| source tokens | examples | " + " | ".join(f"{f} {m}" for m in metrics for f in families) + " |")
    print("|---|---:|" + "---:|" * (len(metrics) * len(families)))
    for bucket in buckets:
        examples = next(scores[bucket]["examples"] for scores in results.values() if bucket in scores)
        cells = [
            f"{results[f][bucket][m]:.3f}"
            if bucket in results[f] and m != "bleu"
            else f"{results[f][bucket][m]:.1f}"
            if bucket in results[f]
            else "-"
            for m in metrics
            for f in families
        ]
        print(f"| {bucket} | {examples} | " + " | ".join(cells) + " |")

    figure = pictures.new_figure(figsize=(5.5 * len(metrics), 4))
    axes = figure.subplots(1, len(metrics), squeeze=False)
    for axis, metric in zip(axes[0], metrics):
        # distinct styles: equal curves stay visible
        for family, style in zip(families, itertools.cycle(STYLES)):
            points = sorted((bucket_start(b) + 5, s[metric]) for b, s in results[family].items())
            axis.plot(*zip(*points), label=family, **style)
        axis.set_xlabel("source length (tokens)")
        axis.set_ylabel(metric.replace("_", " "))
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{args.task}: quality against source length, {args.steps} training steps each")
    figure.tight_layout()
    path = workdir / "length_experiment.png"
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
