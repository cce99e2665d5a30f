"""Every common config field, documented once. Experiment files start from here and change what differs.

An experiment file (`configs/NAME.py`) does

    from configs import base

    def get_config():
        config = base.get_config()
        config.task = base.task("dates", train_size=20_000)    # the task and its own parameters
        config.model = base.model("rnnsearch", hidden_dim=256)  # the model family and its own fields
        config.learning_rate = 3e-4
        ...
        return config

and runs with `python train.py --config=configs/NAME.py --workdir=DIR [--config.a.b=v ...]`
(train.py locks the field set, so a misspelt override fails at once).
A task's and a model family's own parameters, their defaults and their
documentation live in one place, their dataclass: `tasks/dates.py`
`DatesConfig`, `tasks/synthetic.py` `SyntheticConfig`, `tasks/parallel_text.py`
`ParallelTextConfig`, `tasks/catalog.py` `CatalogConfig`;
`models/transformer.py` `TransformerConfig`, `models/rnn.py` `RNNEncDecConfig`,
`RNNSearchConfig`, `LuongConfig`, `models/lstmn.py` `LSTMNConfig`. `task()` and `model()` copy every field with its
default from there, so that each can be overridden from the command line.

Overrides have one syntax, `--config.a.b=value`, wherever a config is read
(train.py, sweep.py and its budgets, the benchmarks): `load(path, overrides)`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from utils.errors import ConfigError, DataError, UserError

# `models` (Flax, JAX) and `tasks` (TFDS) are imported by the functions that read a family's
# fields, not here: sweep.py and its workers load configs and start trials without either (1.3 s
# of every such process's start), unless a config builds its task or model from them.


def task(name: str, **params) -> ml_collections.ConfigDict:
    """`config.task`: the task name (see `tasks.TASKS`, or a TFDS catalog name) and every parameter
    of its dataclass, with `params` replacing their defaults."""
    import tasks

    return ml_collections.ConfigDict({"name": name, **_replaced(tasks.parameters_of(name), params, f"task {name}")})


def model(name: str, **fields) -> ml_collections.ConfigDict:
    """`config.model`: the model family's name (see `models.MODELS`) and every field of its
    dataclass, with `fields` replacing their defaults. Vocabulary sizes and special ids come from
    the vocabulary, not from here."""
    import models

    return ml_collections.ConfigDict({"name": name, **_replaced(models.fields_of(name), fields, f"model {name}")})


def _replaced(defaults: dict, given: dict, what: str) -> dict:
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown field(s) of {what}: {', '.join(unknown)}; valid: {', '.join(sorted(defaults))}")
    return {**defaults, **given}


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    # Seed of parameters, dropout and data order: same seed, same run.
    config.seed = 0
    # Optimizer updates to train for.
    config.num_train_steps = 10_000
    # Global batch: rows per optimizer update, summed over all devices and processes
    # (with packing, a row holds several examples).
    config.batch_size = 64
    # Microbatches per update (gradient accumulation); batch_size must be divisible by it.
    config.grad_accum_steps = 1
    # Microbatches in each iteration of the accumulation loop (`lax.scan`'s unroll): XLA may run
    # them side by side, which keeps a CPU's cores busier; each adds its activations to the step's
    # memory. The same update whatever its value (to rounding).
    config.grad_accum_unroll = 1

    # Peak learning rate (reached at the end of warmup).
    config.learning_rate = 1e-3
    # Linear warmup steps of the schedule.
    config.warmup_steps = 1_000
    # After warmup: "rsqrt" (Vaswani et al. eq. 3: decay with 1/sqrt(step)), "cosine" (to 0 at
    # num_train_steps), or "constant".
    config.schedule = "rsqrt"
    # Adam moments; beta2=0.98 and eps=1e-9 as in Vaswani et al. section 5.3.
    config.adam_b1 = 0.9
    config.adam_b2 = 0.98
    config.adam_eps = 1e-9
    # Decoupled weight decay (AdamW); 0 = plain Adam.
    config.weight_decay = 0.0
    # Clip gradients to this global norm; 0 = no clipping.
    config.grad_clip_norm = 0.0
    # Label smoothing epsilon (Vaswani et al. section 5.4 use 0.1).
    config.label_smoothing = 0.1

    # Steps between log lines / metrics.jsonl training rows.
    config.log_every_steps = 50
    # Steps between evaluations on the dev split (and at the end of training).
    config.eval_every_steps = 1_000
    # Steps between checkpoints (and at the end, and on SIGTERM/SIGINT).
    config.checkpoint_every_steps = 1_000
    # The most recent checkpoints kept (the best one is kept besides).
    config.keep_checkpoints = 3
    # Eval score that picks the best checkpoint and drives early stopping: a score of scoring/score_registry.py
    # that the task writes (whether larger is better is the registry's).
    config.best_metric = "loss"
    # Stop after this many dev evaluations without an improvement of best_metric (then save and
    # evaluate the test split, as at the end); 0 = never stop early.
    config.early_stopping_patience = 0
    # --mode=eval/predict: the step to restore; -1 = the latest, or the best with restore_best.
    config.restore_step = -1
    config.restore_best = False
    # Fine-tuning: a new run starts from another run's parameters (not its optimizer state or step)
    # and reuses its vocabulary: "RUN_DIR" (its latest checkpoint), "RUN_DIR:best" or "RUN_DIR:STEP".
    # "" = from scratch. A model or vocabulary that does not fit is refused, naming the fields.
    config.init_from = ""
    # Examples of the split decoded at each evaluation for the task metric (0 = all).
    config.eval_decode_examples = 0
    # Split that --mode=eval/predict evaluates and decodes.
    config.eval_split = "test"
    # --mode=eval/predict: also evaluate the mean parameters of the last K checkpoints
    # (Vaswani et al. average the last 5 or 20); 0 or 1 = no averaging.
    config.average_last = 0
    # --mode=predict: width, in source tokens, of the length buckets of the per-length scores.
    config.length_bucket_width = 10
    # Dev examples whose attention is drawn at each evaluation (attention/step_<N>/); 0 = none.
    config.visualize_examples = 3
    # Draw self-attention too (encoder and decoder), not only encoder-decoder attention.
    config.visualize_self_attention = False
    # curves.png beside report.html (whose own charts need no library), redrawn at most every 5
    # minutes and when the run ends. False spares a short run matplotlib's import and one drawing:
    # 0.5 s of a tiny train.py's 4 (medians of 3; many short runs: the tests' train.py processes).
    config.curves_png = True

    # Where built datasets are cached (created if missing; relative to the working directory).
    config.data_dir = "data/tfds"
    # The task: see task() above.
    config.task = task("dates")

    config.tokenizer = ml_collections.ConfigDict()
    # "char", "word" (whitespace-separated words, e.g. captions) or "sentencepiece".
    config.tokenizer.kind = "char"
    # SentencePiece (or word) vocabulary size, and SentencePiece's model ("unigram" or "bpe").
    config.tokenizer.vocab_size = 8000
    config.tokenizer.model_type = "unigram"
    # One vocabulary for source and target.
    config.tokenizer.shared = True
    # Characters of the train split the tokenizer is trained on.
    config.tokenizer.max_corpus_chars = 10_000_000
    # Reuse the vocabulary of another run folder instead of training one ("" = train one; init_from
    # reuses its run's already).
    config.tokenizer.from_run = ""

    config.data = ml_collections.ConfigDict()
    # Token limits (eos included): longer training examples are dropped or trimmed.
    config.data.max_source_length = 64
    config.data.max_target_length = 64
    # "drop" or "trim" training examples over the limits (eval examples are always trimmed).
    config.data.length_policy = "drop"
    # "pack" several examples into rows of max lengths, or "bucket" by length and pad.
    config.data.batching = "bucket"
    # Padded lengths of the "bucket" batching.
    config.data.bucket_boundaries = (8, 16, 32, 64, 128, 256, 512)
    # "bucket" batching by tokens: a bucket's batches hold the largest multiple of batch_size rows
    # whose padded slots (rows x the bucket's length) fit in batch_tokens, at least batch_size;
    # short sentences come many to a batch; eval batches, padded to the length limits, get the rows
    # of that length. 0: batch_size rows in every bucket and eval batch.
    config.data.batch_tokens = 0
    # Grain reader threads, and batches prepared ahead in a background thread.
    config.data.num_threads = 2
    config.data.prefetch_batches = 4

    # The model: "name" picks it from models.MODELS, the other fields are its dataclass's; set it
    # with model() above. The Transformer's defaults are the paper's base model.
    config.model = model("transformer")

    config.metrics = ml_collections.ConfigDict()
    # sacreBLEU's tokenizer for BLEU: "13a" (its default), "intl", "zh", "char" or "none"; the
    # signature in eval/step_<N>.json records it.
    config.metrics.bleu_tokenize = "13a"

    config.decode = ml_collections.ConfigDict()
    # "search" (beam search; greedy with beam_size 1) or "sample" (ancestral sampling).
    config.decode.method = "search"
    # Beam width; 1 = greedy search.
    config.decode.beam_size = 1
    # Hypotheses kept per source (an n-best list, at most beam_size): predict writes them to
    # predictions/step_<N>.nbest.tsv; metrics use the best.
    config.decode.num_hypotheses = 1
    # Sampling: temperature, the top_k most likely tokens only (0 = all), the smallest set of
    # tokens with probability top_p only (1 = all; Holtzman et al. 2020).
    config.decode.temperature = 1.0
    config.decode.top_k = 0
    config.decode.top_p = 1.0
    # Length penalty alpha of Wu et al. (2016); 0 = none.
    config.decode.length_penalty = 0.6
    # Output length limit: source length + this offset.
    config.decode.max_length_offset = 50

    # Several processes: the coordinator "host:port", the number of processes and this one's
    # id. Empty/-1 = single process, unless the environment names a coordinator (then
    # jax.distributed.initialize() reads it from there).
    config.coordinator_address = ""
    config.num_processes = -1
    config.process_id = -1

    # Where parameters and optimizer state live, over a (`data`, `model`) mesh of every device:
    # "replicated" (each device holds all of them; right while a model fits one device),
    # "fsdp" (each split along `data` over all devices, ZeRO-3: the most memory saved, one
    # all-gather per layer), or "fsdp_tp" (also heads, feed-forward and vocabulary split along
    # `model`, Megatron style). docs/usage.md, "Models past one device's memory", says how to pick.
    config.sharding = "replicated"
    # fsdp_tp: the `model` axis's size (a divisor of the device count, the heads and d_ff; the
    # `data` axis takes the rest of the devices). 1 for the other modes.
    config.tensor_parallel = 1
    return config


# The fields are parsed and checked once, into typed settings, by `settings.parse(config)`.


def set_field(config: ml_collections.ConfigDict, dotted_name: str, value) -> None:
    """`set_field(config, "model.d_model", 256)`: what `--config.model.d_model=256` does, from code."""
    *parents, leaf = dotted_name.split(".")
    target = config
    for parent in parents:
        target = target[parent]
    target[leaf] = value


# Fields a run folder's config.json may hold that no config sets any more; `with_defaults` drops
# them. `best_metric_larger_is_better`: best_metric's direction is the score registry's (scoring/score_registry.py).
RETIRED_FIELDS = ("best_metric_larger_is_better",)


def with_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` (a run's config.json, say) completed with the common fields it lacks, at their
    defaults, without the retired ones, and with the model's renamed values under their new names: a
    run folder written before a field existed, after one was retired or before a value was renamed
    still loads."""
    completed = get_config()
    saved = {name: value for name, value in config.to_dict().items() if name not in RETIRED_FIELDS}
    families = {name: saved.pop(name) for name in ("task", "model") if name in saved}
    completed.update(saved)
    # an absent field whose default changed meaning reads as it did; an old value name as the new
    if "model" in families:
        import models

        name = families["model"]["name"]
        families["model"] = models.with_new_value_names(name, {**models.fields_before(name), **families["model"]})
    # a task's or model's fields as saved, not merged with others'
    for name, fields in families.items():
        completed[name] = ml_collections.ConfigDict(fields)
    return completed


def read_run_config(workdir: str | Path) -> ml_collections.ConfigDict | None:
    """The resolved config a run wrote to `workdir/config.json` (lists back as tuples), or None;
    completed with the common fields it lacks at their defaults and its renamed values under their
    new names, so that a run folder written before a field existed or a value was renamed still
    resumes, evaluates and loads (`with_defaults`)."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(f"{path} is not a readable config ({error}); restore it or use a fresh workdir") from error
    try:
        return from_saved(saved)
    except UserError:
        raise
    except (TypeError, ValueError) as error:
        raise DataError(f"{path} does not fit today's config fields ({error}); use a fresh workdir") from error


def from_saved(fields: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """A resolved config as JSON held it (a run's config.json, a sweep study's record): each list
    that is a field's value back as a tuple, completed by `with_defaults`.

    Raises:
      TypeError, ValueError: a field's value does not fit the field's type today.
    """
    as_tuples = lambda group: {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}  # noqa: E731
    return with_defaults(ml_collections.ConfigDict(json.loads(json.dumps(fields), object_hook=as_tuples)))


def has_field(config: ml_collections.ConfigDict, dotted_name: str) -> bool:
    """Whether `config` has the field `a.b.c`."""
    *parents, leaf = dotted_name.split(".")
    for parent in parents:
        config = config.get(parent) if isinstance(config, ml_collections.ConfigDict) else None
    return isinstance(config, ml_collections.ConfigDict) and leaf in config


def load(source: str | Path | ml_collections.ConfigDict, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """The locked config of a config file (or a copy of a ConfigDict, such as a run's config.json)
    with `--config.a.b=value` overrides applied.

    The same parser as train.py's flags, so an unknown field, a wrong type or an unparsable value
    raises `ConfigError` naming it. `--config.task.name=X` or `--config.model.name=Y` switch the task
    or the model family first, whatever their place among the overrides: the other family's own
    fields are dropped (with a note) and the new one's, with their defaults, can then be overridden.
    """
    for override in overrides:
        if not override.startswith("--config.") or "=" not in override:
            raise ConfigError(f"config override {override!r} must look like --config.a.b=value")
    if isinstance(source, ml_collections.ConfigDict):
        config, where = ml_collections.ConfigDict(source.to_dict()), "the config"
    else:
        path, argument = split_config_argument(source)
        config, where = _from_file(path, argument), f"config {source}"
    assignments = dict(o.removeprefix("--config.").split("=", 1) for o in overrides)
    _switch_families(config, assignments)
    for name in assignments:
        if not has_field(config, name):
            group, path = config, []
            # the deepest group the name does reach
            for part in name.split(".")[:-1]:
                if not isinstance(group.get(part), ml_collections.ConfigDict):
                    break
                group, path = group[part], [*path, part]
            inside = f" in {'.'.join(path)}" if path else ""
            raise ConfigError(f"{where}: unknown config field {name!r}; valid{inside}: {', '.join(sorted(group))}")
    argv = ["load", *overrides]
    flag_values = flags.FlagValues()
    defaults = {name: _field_value(config, name) for name in assignments}
    # the override flags are made from `argv` when the flag is defined
    try:
        config_flags.DEFINE_config_dict("config", config, flag_values=flag_values, lock_config=True, sys_argv=argv)
        flag_values(argv)
    except Exception as error:
        # ml_collections and absl raise many types; all are about these flags
        root = error.__cause__ or error.__context__ or error
        raise ConfigError(f"{where} {' '.join(overrides)}: {root}") from error
    for name, default in defaults.items():
        _check_sequence(name, default, _field_value(flag_values.config, name))
    return flag_values.config


def _field_value(config: ml_collections.ConfigDict, dotted_name: str):
    for part in dotted_name.split("."):
        config = config[part]
    return config


def _check_sequence(name: str, default, value) -> None:
    """ml_collections lets a string replace a tuple field: a tuple field must stay a tuple of the
    default's element type."""
    if not isinstance(default, tuple):
        return
    kinds = {type(item) for item in default}
    fits = lambda item: not kinds or type(item) in kinds or (float in kinds and type(item) is int)  # noqa: E731
    if not isinstance(value, tuple) or not all(fits(item) for item in value):
        expected = "/".join(sorted(kind.__name__ for kind in kinds)) or "value"
        raise ConfigError(f"{name} must be a tuple of {expected}s like {default!r}, got {value!r}")


def split_config_argument(source: str | Path) -> tuple[Path, str | None]:
    """`FILE.py:ARG` -> `(FILE.py, "ARG")`, ml_collections' `--config` syntax whose file's
    `get_config(ARG)` makes the config (e.g. `configs/wmt14_transformer.py:big`); a plain path
    -> `(path, None)`."""
    text = str(source)
    path, colon, argument = text.rpartition(":")
    if colon and path.endswith(".py"):
        return Path(path), argument
    return Path(text), None


def call_in_file(path: str | Path, function: str, what: str, *arguments):
    """`function(*arguments)` of the Python file at `path` (an experiment or a sweep file).

    Raises:
      ConfigError: naming the `what` file that is missing, does not load, or lacks `function`.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_{what}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, function):
            raise ConfigError(f"{what} file {path} has no {function}()")
        return getattr(module, function)(*arguments)
    except UserError:
        raise
    except Exception as error:
        raise ConfigError(f"{what} file {path} does not load: {type(error).__name__}: {error}") from error


def _from_file(path: Path, argument: str | None = None) -> ml_collections.ConfigDict:
    """`get_config()` of the experiment file at `path`, or `get_config(argument)` given one."""
    config = call_in_file(path, "get_config", "config", *([] if argument is None else [argument]))
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"config file {path}: get_config() must return an ml_collections.ConfigDict")
    return config


def _switch_families(config: ml_collections.ConfigDict, assignments: dict[str, str]) -> None:
    """Replaces `config.task` / `config.model` when an override names another task or model."""
    for field, make in (("task", task), ("model", model)):
        name = assignments.get(f"{field}.name")
        if name is None or not has_field(config, f"{field}.name"):
            # not switched (a config without this group reports the field as unknown later)
            continue
        previous = config[field].name
        if name != previous:
            dropped = sorted(set(config[field]) - {"name"})
            with config.unlocked() if config.is_locked else contextlib.nullcontext():
                config[field] = make(name)
            logging.info(
                "%s.name %s -> %s: its own fields are now %s's (dropped: %s)",
                field,
                previous,
                name,
                name,
                ", ".join(dropped) or "none",
            )
