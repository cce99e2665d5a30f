"""The config, parsed and checked once, into typed frozen settings grouped by concern.

The entry points (train.py, sweep.py, inference.load) turn an
ConfigDict (configs/base.py's) into `Settings` with `parse(config)`; everything
below them takes the settings, or the one group it needs, and never a
ConfigDict. Each field's default and documentation live in `configs/base.py`
(a task's and a model family's own fields in their dataclasses); the
dataclasses here are the schema and the checks, with no defaults of their own.

    settings = parse(config)           # ConfigError naming the first field that cannot work
    settings.optimization.batch_size   # the groups: task, tokenizer, data, model, optimization,
    settings.data.max_source_length    # evaluation, decode, checkpoints, cluster (and the seed)
    settings.as_dict()                 # the resolved config, as config.json holds it

A run folder's `config.json` reads back into the same settings
(`read_run_settings`); `run_setup/compatibility.py` compares a run's settings with a
new command's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import models
import tasks
from run_setup import input_kinds
from scoring import decoding, metrics, score_registry
from tasks.vocabularies import TokenizerSettings
from utils.errors import ConfigError

# sizes and counts beyond this overflow the int32 arithmetic of steps and shapes
LARGEST_INT = 2**31 - 1
SPLIT_NAMES = ("train", "dev", "test")
# where parameters and optimizer state live: run_setup/sharding.py
SHARDINGS = ("replicated", "fsdp", "fsdp_tp")


def _check_numbers(group: Any, prefix: str, *, at_least_one=(), not_negative=(), fractions=(), positive=()) -> None:
    """Each named field of `group` is a finite number, an int within int32, and in its range."""
    for name in (*at_least_one, *not_negative, *fractions, *positive):
        value = getattr(group, name)
        if not math.isfinite(value):
            raise ConfigError(f"{prefix}{name} must be a finite number, got {value}")
        if isinstance(value, int) and abs(value) > LARGEST_INT:
            raise ConfigError(f"{prefix}{name} must be at most {LARGEST_INT}, got {value}")
    for names, holds, what in (
        (at_least_one, lambda v: v >= 1, "at least 1"),
        (not_negative, lambda v: v >= 0, "not negative"),
        (fractions, lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
        (positive, lambda v: v > 0, "positive"),
    ):
        for name in names:
            if not holds(getattr(group, name)):
                raise ConfigError(f"{prefix}{name} must be {what}, got {getattr(group, name)}")


# ----------------------------------------------------------------------------- the groups


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """`config.task` and `config.data_dir`: which data, built where."""

    name: str
    data_dir: str
    # the task's own parameters (its dataclass's fields), name left out
    params: Mapping[str, Any]

    def __post_init__(self):
        if not self.data_dir.strip():
            raise ConfigError("data_dir must not be empty")
        tasks.check_parameters(self.name, **self.params)

    @property
    def inputs(self) -> str:
        """What the task's records hold as sources: "text" or "image" (an array)."""
        return tasks.inputs_of(self.name)


# tokens: one row's [L, L] attention scores would already need 16 GiB per head
MAX_LENGTH = 65_536
MAX_THREADS = 256
# padded slots per batch: beyond this one batch's float32 activations alone fill a device
MAX_BATCH_TOKENS = 2**24
BATCHINGS = ("pack", "bucket")
LENGTH_POLICIES = ("drop", "trim")


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """`config.data` with the global batch size and the seed: what the input pipeline needs."""

    # global: the sum over processes
    batch_size: int
    seed: int
    # tokens, eos included
    max_source_length: int
    max_target_length: int
    length_policy: str
    batching: str
    bucket_boundaries: tuple[int, ...]
    batch_tokens: int
    num_threads: int
    prefetch_batches: int

    def __post_init__(self):
        if self.batching not in BATCHINGS:
            raise ConfigError(f"data.batching must be one of {', '.join(BATCHINGS)}, got {self.batching!r}")
        if self.length_policy not in LENGTH_POLICIES:
            raise ConfigError(
                f"data.length_policy must be one of {', '.join(LENGTH_POLICIES)}, got {self.length_policy!r}"
            )
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {self.batch_size}")
        for name, highest in (
            ("max_source_length", MAX_LENGTH),
            ("max_target_length", MAX_LENGTH),
            ("num_threads", MAX_THREADS),
            ("prefetch_batches", MAX_THREADS),
        ):
            lowest = 0 if name == "prefetch_batches" else 1
            if not lowest <= getattr(self, name) <= highest:
                raise ConfigError(f"data.{name} must be in [{lowest}, {highest}], got {getattr(self, name)}")
        boundaries = list(self.bucket_boundaries)
        if not boundaries or boundaries != sorted(set(boundaries)) or boundaries[0] < 1:
            raise ConfigError(
                f"data.bucket_boundaries must be increasing positive lengths, got {self.bucket_boundaries}"
            )
        if not 0 <= self.batch_tokens <= MAX_BATCH_TOKENS:
            raise ConfigError(f"data.batch_tokens must be in [0, {MAX_BATCH_TOKENS}], got {self.batch_tokens}")
        if self.batch_tokens and self.batching != "bucket":
            raise ConfigError(
                "data.batch_tokens sizes the batches of data.batching='bucket'; packed rows are full already"
            )

    def bucket_rows(self, length: int) -> int:
        """Rows (global) of a "bucket" batch padded to `length`: `batch_size`, or with `batch_tokens` the
        largest multiple of `batch_size` whose rows x `length` fit in it (at least `batch_size`)."""
        if not self.batch_tokens:
            return self.batch_size
        return max(self.batch_tokens // length // self.batch_size, 1) * self.batch_size

    def eval_rows(self) -> int:
        """Rows (global) of an eval batch, which is padded to the length limits: `batch_size`, or with
        `batch_tokens` the rows a batch of that length gets."""
        return self.bucket_rows(max(self.max_source_length, self.max_target_length))

    def padded_length(self, boundary: int) -> int:
        """The longer side of a batch of the bucket of `boundary`, within the length limits."""
        return min(boundary, max(self.max_source_length, self.max_target_length))


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """`config.model`: the family's name and its own fields (vocabulary sizes come from the vocabulary)."""

    name: str
    fields: Mapping[str, Any]

    def __post_init__(self):
        models.checked_config(self.name, **self.fields)

    @property
    def hyperparameters(self):
        """The family's dataclass of these fields (the vocabulary's fields as placeholders)."""
        return models.checked_config(self.name, **self.fields)

    @property
    def source(self) -> input_kinds.SourceKind:
        """The kind of source this model reads."""
        return input_kinds.KINDS[models.source_kind_of(self.name, self.fields)]


SCHEDULES = ("rsqrt", "cosine", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizationSettings:
    """The optimizer, its schedule and the loss: what one training step does, and how many."""

    num_train_steps: int
    # global rows per update
    batch_size: int
    grad_accum_steps: int
    # microbatches an iteration of the accumulation loop
    grad_accum_unroll: int
    learning_rate: float
    warmup_steps: int
    schedule: str
    adam_b1: float
    adam_b2: float
    adam_eps: float
    weight_decay: float
    grad_clip_norm: float
    label_smoothing: float
    log_every_steps: int

    def __post_init__(self):
        _check_numbers(
            self,
            "",
            at_least_one=("num_train_steps", "batch_size", "grad_accum_steps", "grad_accum_unroll", "log_every_steps"),
            not_negative=("warmup_steps", "learning_rate", "weight_decay", "grad_clip_norm"),
            fractions=("label_smoothing", "adam_b1", "adam_b2"),
            positive=("adam_eps",),
        )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")


@dataclasses.dataclass(frozen=True)
class EvaluationSettings:
    """When and what to evaluate, which score picks the best checkpoint, and what to draw."""

    eval_every_steps: int
    # 0 = all
    eval_decode_examples: int
    eval_split: str
    length_bucket_width: int
    visualize_examples: int
    visualize_self_attention: bool
    curves_png: bool
    bleu_tokenize: str
    # a score of scoring/score_registry.py that the task writes; its direction is the registry's
    best_metric: str
    # 0 = never
    early_stopping_patience: int

    def __post_init__(self):
        _check_numbers(
            self,
            "",
            at_least_one=("eval_every_steps", "length_bucket_width"),
            not_negative=("eval_decode_examples", "visualize_examples", "early_stopping_patience"),
        )
        if self.eval_split not in SPLIT_NAMES:
            raise ConfigError(f"eval_split must be one of {', '.join(SPLIT_NAMES)}, got {self.eval_split!r}")
        if not self.best_metric.strip():
            raise ConfigError("best_metric must not be empty")
        if self.bleu_tokenize not in metrics.BLEU_TOKENIZERS:
            raise ConfigError(
                f"metrics.bleu_tokenize must be one of {', '.join(metrics.BLEU_TOKENIZERS)}, got {self.bleu_tokenize!r}"
            )


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """How often to save and how many to keep; which checkpoint eval, predict and inference restore."""

    checkpoint_every_steps: int
    keep_checkpoints: int
    # -1 = the latest (or the best, with restore_best)
    restore_step: int
    restore_best: bool
    # 0 or 1 = no averaging
    average_last: int

    def __post_init__(self):
        _check_numbers(
            self, "", at_least_one=("checkpoint_every_steps", "keep_checkpoints"), not_negative=("average_last",)
        )
        if self.restore_step < -1:
            raise ConfigError(f"restore_step must be a step, or -1 for the latest; got {self.restore_step}")

    @property
    def step_to_restore(self) -> int | None:
        return self.restore_step if self.restore_step >= 0 else None


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """`config.decode`: the search (or sampling) of evaluation, predict and inference."""

    method: str
    beam_size: int
    num_hypotheses: int
    temperature: float
    top_k: int
    top_p: float
    length_penalty: float
    max_length_offset: int

    def __post_init__(self):
        if self.method not in decoding.METHODS:
            raise ConfigError(f"decode.method must be one of {', '.join(decoding.METHODS)}, got {self.method!r}")
        if self.beam_size < 1:
            raise ConfigError(f"decode.beam_size must be at least 1, got {self.beam_size}")
        if not 1 <= self.num_hypotheses <= (self.beam_size if self.method == "search" else 1):
            raise ConfigError(
                f"decode.num_hypotheses must be between 1 and decode.beam_size ({self.beam_size}) for search, "
                f"and 1 for sampling; got {self.num_hypotheses}"
            )
        for name, holds, what in (
            ("temperature", self.temperature > 0 and math.isfinite(self.temperature), "positive and finite"),
            ("top_k", self.top_k >= 0, "at least 0 (0 = every token)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("length_penalty", 0 <= self.length_penalty < math.inf, "finite and not negative"),
            ("max_length_offset", self.max_length_offset >= 0, "not negative"),
        ):
            if not holds:
                raise ConfigError(f"decode.{name} must be {what}, got {getattr(self, name)}")

    def with_options(self, **options) -> DecodeSettings:
        """These settings with `options` (e.g. `beam_size=4`; None keeps a field) replaced, checked."""
        known = {field.name for field in dataclasses.fields(self)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown decode option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        return dataclasses.replace(self, **{k: v for k, v in options.items() if v is not None})

    def search_options(self) -> dict:
        """`decoding.decode()`'s keyword arguments."""
        return dict(
            method=self.method,
            beam_size=self.beam_size,
            alpha=self.length_penalty,
            num_hypotheses=self.num_hypotheses,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_length_offset=self.max_length_offset,
        )


@dataclasses.dataclass(frozen=True)
class InitSettings:
    """Where a new run's parameters and vocabulary come from when not from scratch (`init_from`,
    `tokenizer.from_run`). A run that has checkpoints of its own resumes from them instead."""

    # a run folder whose parameters start this run; "" = from scratch
    run: str
    # of that run: "latest", "best" or a step
    checkpoint: str
    # a run folder whose vocabulary this run reuses; "" = train one
    vocabulary_from: str

    @classmethod
    def parse(cls, init_from: str, vocabulary_from: str) -> InitSettings:
        """From `init_from` ("RUN_DIR", "RUN_DIR:best" or "RUN_DIR:STEP") and `tokenizer.from_run`."""
        run, _, checkpoint = init_from.rpartition(":")
        if not run or not (checkpoint == "best" or checkpoint.isdigit()):
            run, checkpoint = init_from, "latest"
        if vocabulary_from and run and Path(vocabulary_from).resolve() != Path(run).resolve():
            raise ConfigError(
                f"tokenizer.from_run {vocabulary_from} differs from init_from's run {run}: "
                "a run's parameters only fit its own vocabulary"
            )
        return cls(run, checkpoint, vocabulary_from or run)

    @property
    def step(self) -> int | None:
        """The checkpoint step asked for (None: the latest, or the best)."""
        return int(self.checkpoint) if self.checkpoint.isdigit() else None


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    """Several processes: the coordinator "host:port", their number and this one's id ("" / -1: one
    process, unless the environment names a coordinator); and where parameters and optimizer state
    live (`sharding`, with `tensor_parallel` devices on the mesh's `model` axis: run_setup/sharding.py)."""

    coordinator_address: str
    num_processes: int
    process_id: int
    sharding: str = "replicated"
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        _check_numbers(self, "", at_least_one=("tensor_parallel",))
        if self.tensor_parallel != 1 and self.sharding != "fsdp_tp":
            raise ConfigError(
                f"tensor_parallel {self.tensor_parallel} needs sharding='fsdp_tp', but sharding is {self.sharding!r} "
                "(no model axis): set tensor_parallel=1 or sharding='fsdp_tp'"
            )


# ----------------------------------------------------------------------------- the whole


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every group of a run's settings; `as_dict()` is the resolved config (config.json)."""

    seed: int
    task: TaskSettings
    tokenizer: TokenizerSettings
    data: PipelineSettings
    model: ModelSettings
    optimization: OptimizationSettings
    evaluation: EvaluationSettings
    decode: DecodeSettings
    checkpoints: CheckpointSettings
    init: InitSettings
    cluster: ClusterSettings
    # the config as a nested dict
    fields: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The resolved config as a nested dict (tuples stay tuples): what config.json holds."""
        return copy_tree(self.fields)

    def replace(self, **groups) -> Settings:
        """These settings with whole groups replaced (e.g. `cluster=ClusterSettings("", -1, -1)`)."""
        return dataclasses.replace(self, **groups)

    @property
    def source(self) -> input_kinds.SourceKind:
        """The kind of the run's sources (text, image, feature grid): see run_setup/input_kinds.py."""
        return self.model.source

    def output_length(self, max_length_offset: int | None = None) -> int:
        """The longest decoded output: the source length plus `decode.max_length_offset` (or the one
        given), or for sources without a length (an image) `data.max_target_length`."""
        if not self.source.has_length:
            return self.data.max_target_length
        offset = self.decode.max_length_offset if max_length_offset is None else max_length_offset
        return self.data.max_source_length + offset


def copy_tree(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: copy_tree(v) for k, v in tree.items()}
    return tuple(tree) if isinstance(tree, (list, tuple)) else tree


def parse(config: Any) -> Settings:
    """The settings of a resolved config (a ConfigDict, or its `to_dict()`).

    Raises:
      ConfigError: naming the first field whose value cannot work, alone or with the others.
    """
    fields = copy_tree(config if isinstance(config, Mapping) else config.to_dict())
    try:
        settings = _groups(fields)
    except KeyError as error:
        raise ConfigError(f"the config has no field {error.args[0]!r}") from error
    check_together(settings)
    return settings


def _groups(f: dict) -> Settings:
    """The groups, checked one by one in the order a reader meets them in configs/base.py."""
    own = lambda group: {k: v for k, v in f[group].items() if k != "name"}  # noqa: E731
    optimization = OptimizationSettings(
        **{field.name: f[field.name] for field in dataclasses.fields(OptimizationSettings)}
    )
    evaluation = EvaluationSettings(
        **{
            name: f[name]
            for name in (
                "eval_every_steps",
                "eval_decode_examples",
                "eval_split",
                "length_bucket_width",
                "visualize_examples",
                "visualize_self_attention",
                "curves_png",
                "best_metric",
                "early_stopping_patience",
            )
        },
        bleu_tokenize=f["metrics"]["bleu_tokenize"],
    )
    checkpoints = CheckpointSettings(**{field.name: f[field.name] for field in dataclasses.fields(CheckpointSettings)})
    if not 0 <= f["seed"] <= LARGEST_INT:
        raise ConfigError(f"seed must be in [0, {LARGEST_INT}], got {f['seed']}")
    task = TaskSettings(f["task"]["name"], f["data_dir"], own("task"))
    data = PipelineSettings(batch_size=f["batch_size"], seed=f["seed"], **f["data"])
    tokenizer = TokenizerSettings(**{k: v for k, v in f["tokenizer"].items() if k != "from_run"})
    init = InitSettings.parse(f["init_from"], f["tokenizer"]["from_run"])
    decode = DecodeSettings(**f["decode"])
    model = ModelSettings(f["model"]["name"], own("model"))
    cluster = ClusterSettings(
        f["coordinator_address"], f["num_processes"], f["process_id"], f["sharding"], f["tensor_parallel"]
    )
    return Settings(
        f["seed"], task, tokenizer, data, model, optimization, evaluation, decode, checkpoints, init, cluster, f
    )


def check_together(settings: Settings) -> None:
    """How the groups fit together: what the model reads is what the task gives, one vocabulary where
    embeddings are shared, lengths within the model's longest sequence."""
    task, model, data, kind = settings.task, settings.model, settings.data, settings.source
    metric, alignment, boxes = tasks.scoring_of(task.name)
    score_registry.check_best_metric(settings.evaluation.best_metric, metric, alignment=alignment, boxes=boxes)
    if task.inputs != kind.task_inputs:
        raise ConfigError(
            f"task {task.name!r} has {task.inputs} sources, but model {model.name!r} reads {kind.task_inputs}; "
            f"pair a captioning task with model.name='captioner' and a text task with a translation model"
        )
    if not kind.packs and data.batching != "bucket":
        raise ConfigError(
            f"task {task.name!r} reads {kind.name} sources, which do not pack; set data.batching='bucket'"
        )
    hyperparameters = model.hyperparameters
    if hyperparameters.needs_shared_vocabulary and not settings.tokenizer.shared:
        raise ConfigError(
            "model.share_embeddings=True needs one vocabulary for source and target, but tokenizer.shared=False "
            "trains two; set tokenizer.shared=True or model.share_embeddings=False"
        )
    limit = hyperparameters.length_limit
    lengths = {
        "data.max_source_length": data.max_source_length,
        "data.max_target_length": data.max_target_length,
        "data.max_source_length + decode.max_length_offset": data.max_source_length + settings.decode.max_length_offset,
    }
    for name, length in lengths.items():
        if limit is not None and length > limit:
            raise ConfigError(
                f"{name} = {length} is longer than model.max_length = {limit}, the model's longest sequence"
            )


# ----------------------------------------------------------------------------- run folders


def read_run_settings(workdir: str | Path) -> Settings | None:
    """The settings of the run in `workdir` (its config.json), or None where there is none; a run
    folder written before a field existed gets that field's default, and an old value name its new
    one (`configs.base.with_defaults`)."""
    # the config files' module: it turns config.json back into a config
    from configs import base

    config = base.read_run_config(workdir)
    return None if config is None else parse(config)


def write_run_config(settings: Settings, workdir: Path) -> None:
    """`workdir/config.json`: the resolved config, which `read_run_settings` reads back."""
    (workdir / "config.json").write_text(json.dumps(settings.as_dict(), indent=2, default=list) + "\n")


def single_process(settings: Settings) -> Settings:
    """`settings` for one process on one device, whatever trained the run and how (inference): its
    parameters replicated, whatever sharding the run trained with (a checkpoint reshards on restore)."""
    fields = {
        **settings.as_dict(),
        "coordinator_address": "",
        "num_processes": -1,
        "process_id": -1,
        "sharding": "replicated",
        "tensor_parallel": 1,
    }
    return parse(fields)
