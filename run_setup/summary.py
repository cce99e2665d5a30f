"""The start-up summary a run logs before its first step: where it runs, what it trains, on what
data, with which batch and vocabulary, and where its outputs go.

`log_start(run, start_step)` is the one call (engine/training_loop.py's); `gather_facts` gathers the facts (nothing is
tokenized for them: the train lengths come from the token-id cache the pipeline filled), and
`format_summary(facts)` is the pure text of them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from run_setup.settings import PipelineSettings
from utils import allocator

# what a training run writes into its workdir, and what each is
OUTPUTS = (
    ("config.json", "the resolved config"),
    ("metrics.jsonl", "one JSON row per logged event"),
    ("log.txt", "this log"),
    ("tensorboard/", "event files: tensorboard --logdir"),
    ("checkpoints/", "Orbax: the last ones and the best"),
    ("eval/", "scores of each evaluation"),
    ("attention/", "attention pictures and weights of dev examples"),
    ("report.html", "the run's page: curves, examples, attention"),
)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What `format_summary` shows. Token counts are None where they are not known cheaply."""

    backend: str
    # one entry per kind of device: "8 x cpu"
    devices: Sequence[str]
    processes: int
    # by top-level module
    parameters: Mapping[str, int]
    # split -> (examples, source tokens, target tokens)
    splits: Mapping[str, tuple[int, int | None, int | None]]
    # global rows per step (all processes; the microbatches of accumulation together)
    batch_rows: int
    # about this many (source, target) tokens per step, padding left out
    batch_tokens: tuple[float | None, float]
    steps_per_epoch: float
    num_train_steps: int
    start_step: int
    # kind, size, shared or not
    vocabulary: str
    vocabulary_folder: str
    workdir: str
    outputs: Sequence[tuple[str, str]] = OUTPUTS
    # allocator.chosen
    malloc: str = "malloc's defaults"


def epoch_estimate(lengths: np.ndarray, data: PipelineSettings) -> tuple[float, tuple[float, float]]:
    """`(steps per epoch, (source, target) tokens per step)` of the train examples' `lengths`
    `[N, 2]` (eos included), about: packing fills rows of `max_*_length` tokens, buckets hold
    `bucket_rows` examples of their length; examples are trimmed to the limits, none dropped."""
    limits = np.array([data.max_source_length, data.max_target_length])
    lengths = np.minimum(np.asarray(lengths, np.int64).reshape(-1, 2), limits)
    totals = lengths.sum(axis=0).astype(float)
    if len(lengths) == 0:
        return 0.0, (0.0, 0.0)
    if data.batching == "pack":
        steps = float(np.max(totals / (data.batch_size * limits)))
    else:
        boundaries = np.asarray(data.bucket_boundaries)
        bucket = np.minimum(np.searchsorted(boundaries, lengths.max(axis=1)), len(boundaries) - 1)
        rows = np.array([data.bucket_rows(data.padded_length(int(b))) for b in boundaries])[bucket]
        steps = float(np.sum(1.0 / rows))
    return steps, (totals[0] / steps, totals[1] / steps)


def _tokens(source: float | None, target: float) -> str:
    """`12 source + 34 target tokens`, or `34 target tokens` for sources that are not tokens (images)."""
    return ("" if source is None else f"{source:,.0f} source + ") + f"{target:,.0f} target tokens"


def format_summary(facts: Facts) -> str:
    """The summary as aligned lines, e.g. `parameters:  5,320 (decoder_layers 3,312, ...)`."""
    total = sum(facts.parameters.values())
    by_module = ", ".join(
        f"{name} {count:,}" for name, count in sorted(facts.parameters.items(), key=lambda item: -item[1])
    )
    splits = "; ".join(
        f"{split} {examples:,} examples" + ("" if target is None else f", {_tokens(source, target)}")
        for split, (examples, source, target) in facts.splits.items()
    )
    epochs = (facts.num_train_steps - facts.start_step) / facts.steps_per_epoch if facts.steps_per_epoch else math.inf
    steps = f"{facts.num_train_steps:,}" + (f" (from step {facts.start_step:,})" if facts.start_step else "")
    lines = [
        (
            "devices",
            f"{facts.backend}: {', '.join(facts.devices)}; "
            f"{facts.processes} process{'es' if facts.processes > 1 else ''}; malloc: {facts.malloc}",
        ),
        ("parameters", f"{total:,} ({by_module})"),
        ("data", splits),
        ("batch", f"{facts.batch_rows:,} rows, about {_tokens(*facts.batch_tokens)} a step"),
        ("steps", f"{steps}; about {facts.steps_per_epoch:,.1f} a train epoch, {epochs:,.1f} epochs to go"),
        ("vocabulary", f"{facts.vocabulary} in {facts.vocabulary_folder}"),
        ("workdir", facts.workdir),
    ]
    # two spaces after the longest name and its colon
    width = max(len(name) for name, _ in lines) + 3
    text = [f"{name + ':':<{width}}{value}" for name, value in lines]
    text += [f"{'':<{width}}{name:<15}{what}" for name, what in facts.outputs]
    return "start-up summary\n" + "\n".join(text)


def device_kinds(devices: Sequence[jax.Device]) -> list[str]:
    """`["8 x cpu"]`: how many devices of each kind."""
    kinds = [device.device_kind for device in devices]
    return [f"{kinds.count(kind)} x {kind}" for kind in dict.fromkeys(kinds)]


def log_start(run, start_step: int) -> None:
    """Logs the summary of a prepared `run_setup.run.Run` about to train from `start_step` (first process)."""
    if run.is_chief:
        logging.info("%s", format_summary(gather_facts(run, start_step)))


def gather_facts(run, start_step: int) -> Facts:
    """The `Facts` of a prepared `run_setup.run.Run` (its train lengths come from the token-id cache
    the pipeline filled, so nothing is tokenized again)."""
    settings = run.settings
    lengths = settings.source.lengths(run.task, "train", run.tokens)  # [N, 2]
    steps, batch_tokens = epoch_estimate(lengths, settings.data)
    totals = np.asarray(lengths).reshape(-1, 2).sum(axis=0)
    # sources padded in length are token ids
    tokens_in_sources = "inputs" in settings.source.padded_keys(1, 1)
    splits = {"train": (len(run.task.splits["train"]), int(totals[0]) if tokens_in_sources else None, int(totals[1]))}
    splits.update((split, (len(records), None, None)) for split, records in run.task.splits.items() if split != "train")
    if not tokens_in_sources:
        batch_tokens = (None, batch_tokens[1])
    tokens, tokenizer = run.tokens, settings.tokenizer
    sizes = f"{tokens.source.vocab_size:,}" + (
        "" if tokens.source is tokens.target else f" / {tokens.target.vocab_size:,}"
    )
    return Facts(
        malloc=allocator.chosen,
        backend=jax.default_backend(),
        devices=device_kinds(list(run.mesh.devices.flat)),
        processes=jax.process_count(),
        parameters={name: sum(int(leaf.size) for leaf in jax.tree.leaves(part)) for name, part in run.params.items()},
        splits=splits,
        batch_rows=settings.data.batch_size,
        batch_tokens=batch_tokens,
        steps_per_epoch=steps,
        num_train_steps=settings.optimization.num_train_steps,
        start_step=start_step,
        vocabulary=(
            f"{tokenizer.kind}, {sizes} ids, {'shared' if tokens.source is tokens.target else 'source / target'}"
        ),
        vocabulary_folder=str(run.workdir / "tokenizer"),
        workdir=str(run.workdir),
        outputs=[
            (name, what) for name, what in OUTPUTS if name != "attention/" or settings.evaluation.visualize_examples
        ],
    )
