"""A run folder's settings against a new command's: a resumed run must be the same run, and
eval/predict take only evaluation fields from the command line."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from run_setup.settings import Settings, copy_tree, parse, read_run_settings
from utils.errors import ConfigError

# The fields that make a run what it is: its checkpoints, vocabulary and data only fit these.
RUN_IDENTITY = ("seed", "model", "task", "tokenizer", "data")
# Model fields a resumed or evaluated run keeps from its config.json whatever the command says, so
# that a run goes on as it began and a command with today's defaults resumes it: how its dropout masks
# are drawn (a run made before the field existed reads back as "bernoulli", its family's
# `fields_before`), and whether the Transformer's attention projections have biases (they did by
# default until 2026-11-28; the paper's have none).
KEPT_ON_RESUME = ("dropout_masks", "use_bias")
# The fields --mode=eval and --mode=predict may set for a run folder (data_dir: the folder moved).
EVALUATION_FIELDS = (
    "eval_split",
    "restore_step",
    "restore_best",
    "average_last",
    "decode",
    "eval_decode_examples",
    "length_bucket_width",
    "visualize_examples",
    "visualize_self_attention",
    "curves_png",
    "data_dir",
    "metrics",
    # how this command runs, not what the run is
    "coordinator_address",
    "num_processes",
    "process_id",
    "sharding",
    "tensor_parallel",
)


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """`{"model.d_model": 128, ...}`: the leaves of a nested dict by dotted name."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return flat


def differences(saved: Settings, new: Settings, groups: Sequence[str]) -> list[str]:
    """`"name: saved -> new"` for each field of `groups` (a group, or a field by its dotted name) that differs."""
    return field_differences(saved.fields, new.fields, groups)


def field_differences(saved: Mapping, new: Mapping, groups: Sequence[str]) -> list[str]:
    """`differences` of two configs as nested dicts."""

    def flat(fields: Mapping) -> dict[str, Any]:
        return {
            name: value for name, value in flatten(fields).items() if name.split(".")[0] in groups or name in groups
        }

    before, after = flat(saved), flat(new)
    return [
        f"{name}: {before.get(name, '(absent)')!r} -> {after.get(name, '(absent)')!r}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    ]


def check_resume(settings: Settings, workdir: Path) -> Settings:
    """The settings a rerun on a run folder resumes with: it must be the same run, so a changed model,
    task, vocabulary, data or seed field stops here, before anything is written, but those of
    `KEPT_ON_RESUME`, which keep the run's value. Other changes (steps, schedule, intervals,
    decoding, logging) are allowed and logged."""
    saved = read_run_settings(workdir)
    if saved is None:
        return settings
    settings = with_run_kept_fields(settings, saved)
    changed = differences(saved, settings, RUN_IDENTITY)
    if changed:
        raise ConfigError(
            f"{workdir} holds a run with another config: {'; '.join(changed)}. Resume with the same "
            "model, task, tokenizer, data and seed fields, or use a fresh workdir"
        )
    other = [group for group in settings.fields if group not in RUN_IDENTITY]
    for change in differences(saved, settings, other):
        logging.info("resuming with a changed field, %s", change)
    return settings


def kept_fields(fields: Mapping, saved: Mapping) -> dict[str, Any]:
    """`{field: the run's value}` for each model field of `KEPT_ON_RESUME` where the config `fields`
    differs from the run's (`saved`; both nested dicts)."""
    own, run = fields["model"], saved["model"]
    return {field: run[field] for field in KEPT_ON_RESUME if field in own and field in run and own[field] != run[field]}


def with_run_kept_fields(settings: Settings, saved: Settings) -> Settings:
    """`settings` with each of `KEPT_ON_RESUME` at the run's (`saved`) value, logged where the
    command's differs."""
    kept, own = kept_fields(settings.fields, saved.fields), settings.fields["model"]
    for field, value in kept.items():
        logging.info("model.%s: %r, as the run began (the command's %r is for new runs)", field, value, own[field])
    return parse({**settings.as_dict(), "model": {**own, **kept}}) if kept else settings


def as_the_run_began(settings: Settings, workdir: Path) -> Settings:
    """`settings` with the `KEPT_ON_RESUME` fields of the run in `workdir`, where it holds one: for a
    script that builds a run's model from its own config rather than the run's config.json."""
    saved = read_run_settings(workdir)
    return settings if saved is None else with_run_kept_fields(settings, saved)


def for_evaluation(saved: Settings, requested: Settings, overridden: Sequence[str]) -> Settings:
    """The settings --mode=eval/predict run with: the run's own (`saved`), with the evaluation fields
    of `requested` (a config file or overrides). A model, task, vocabulary, data or seed field of
    `requested` that differs from the run's stops with its name. `eval_decode_examples` (decode a
    subset) carries over only when `overridden` names it: by default the whole split is decoded.
    Fields of `KEPT_ON_RESUME` are the run's."""
    requested = with_run_kept_fields(requested, saved)
    changed = differences(saved, requested, RUN_IDENTITY)
    if changed:
        raise ConfigError(
            f"eval/predict read the run's config.json; these fields differ from it: {'; '.join(changed)}. "
            f"Only evaluation fields may change: {', '.join(EVALUATION_FIELDS)}"
        )
    fields = {**saved.as_dict(), **{name: copy_tree(requested.fields[name]) for name in EVALUATION_FIELDS}}
    if "eval_decode_examples" not in overridden:
        fields["eval_decode_examples"] = 0
    return parse(fields)


def check_init(settings: Settings, workdir: Path) -> Settings | None:
    """The settings of the run that `init_from` / `tokenizer.from_run` name, checked against
    `settings` before anything is written: it is a run folder, its vocabulary settings are these,
    and (for `init_from`) its model's fields are these, but those that shape no parameter
    (dropout, say), which may change when fine-tuning. None when neither is set, or when the run in
    `workdir` has checkpoints of its own (it resumes from them).

    Raises:
      ConfigError: naming the folder that is not a run, or the fields that differ.
    """
    init, own_checkpoints = settings.init, Path(workdir) / "checkpoints"
    if not init.vocabulary_from or (own_checkpoints.is_dir() and any(own_checkpoints.iterdir())):
        return None
    what = "init_from" if init.run else "tokenizer.from_run"
    source = read_run_settings(init.vocabulary_from)
    if source is None:
        raise ConfigError(f"{what} {init.vocabulary_from} is not a run folder (no config.json there)")
    changed = differences(
        source,
        settings,
        (
            "tokenizer.kind",
            "tokenizer.vocab_size",
            "tokenizer.model_type",
            "tokenizer.shared",
            "tokenizer.max_corpus_chars",
        ),
    )
    if changed:
        raise ConfigError(
            f"{what} {init.vocabulary_from}: its vocabulary was made with other settings: {'; '.join(changed)}; "
            "use the run's tokenizer fields"
        )
    if init.run and not same_parameter_shapes(source, settings):
        changed = differences(source, settings, ("model",))
        raise ConfigError(
            f"init_from {init.run}: its parameters do not fit this model ({'; '.join(changed)}); "
            "change only fields that shape no parameter (dropout rates, say)"
        )
    return source


def same_parameter_shapes(source: Settings, settings: Settings) -> bool:
    """Whether the two settings' models have the same parameters, names and shapes (built abstractly
    with one vocabulary size: the vocabulary is the source run's either way)."""
    import jax
    from flax import nnx

    import models

    def shapes(model_settings) -> dict:
        fields = {**model_settings.fields, "vocab_size": 64, "source_vocab_size": 64, "bos_id": 1, "pad_id": 0}
        abstract = nnx.eval_shape(lambda: models.create_model(model_settings.name, rngs=nnx.Rngs(0), **fields))
        return jax.tree.map(lambda leaf: leaf.shape, nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))

    return source.model.name == settings.model.name and shapes(source.model) == shapes(settings.model)
