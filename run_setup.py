"""The set-up that training, evaluation and inference share: devices, data and vocabulary, the model,
its checkpoints, and restoring (or averaging) its parameters.

`prepare_run(config, workdir)` returns a `Run`. trainer.py, evaluation.py and
inference.py each build on it and import nothing of each other (trainer.py
calls evaluation.py to evaluate during training, one way).

Devices: one `Mesh` over every device of every process, batches sharded along
`data`, parameters replicated. Inside a jitted function the model is
`run.model(params)`: the NNX graph merged with the (traced) parameters.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import decoding
import metrics
import models
import tasks
import vocabularies
from checkpoints import Checkpoints
from configs import base
from errors import CheckpointError, ConfigError, DataError, WorkdirInUse
from input_pipeline import PipelineSettings

# ----------------------------------------------------------------------------- devices


def setup_distributed(config: ml_collections.ConfigDict) -> None:
    """Joins the other processes when the config names a coordinator, or the environment does
    (`JAX_COORDINATOR_ADDRESS`), or JAX detects a cluster of several processes (SLURM, Open MPI,
    Kubernetes, Cloud TPU pods): then `jax.distributed.initialize()` reads it all from there."""
    if jax.distributed.is_initialized():
        return
    if config.coordinator_address:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
        )
    elif os.environ.get("JAX_COORDINATOR_ADDRESS") or detected_cluster():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()


def detected_cluster() -> str | None:
    """The cluster that JAX's own detection (the one `jax.distributed.initialize()` runs) finds
    with more than one process, by name (`"slurm"`, `"ompi"`, ...), or None. A one-task job, such
    as a SLURM allocation without srun, is no cluster: it trains alone."""
    from jax._src.clusters import ClusterEnv  # JAX exports no public name for its detection

    for cluster in ClusterEnv._cluster_types:
        if not cluster.opt_in_only_method and cluster.is_env_present():
            return cluster.name if cluster.get_process_count() > 1 else None
    return None


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh (`data`) over `devices` (default: every device of every process)."""
    return Mesh(np.array(jax.devices() if devices is None else devices), ("data",))


def device_memory_bytes(device: jax.Device) -> int:
    """The memory a device may use: its allocator's limit (accelerators), else the host's RAM."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_device(mesh: Mesh) -> jax.Device:
    """A device of `mesh` that this process holds (only those answer `memory_stats`)."""
    return next(device for device in mesh.devices.flat if device.process_index == jax.process_index())


def gathered(array) -> np.ndarray:
    """A global array in full on every process."""
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


# ----------------------------------------------------------------------------- data and vocabulary


def load_task_and_tokenizers(config: ml_collections.ConfigDict, workdir: Path) -> tuple[tasks.Task, vocabularies.Tokenizers]:
    """The task's data (built if needed) and the run's tokenizers (trained on its train split if needed).

    With several processes, the first builds and trains while the others wait, then they
    read what it wrote: concurrent builds into one data_dir or workdir would race.
    """

    def load() -> tuple[tasks.Task, vocabularies.Tokenizers]:
        params = {k: v for k, v in config.task.to_dict().items() if k != "name"}
        task = tasks.load_task(config.task.name, config.data_dir, **params)
        check_task_images(task, config)  # before a tokenizer is trained and written
        train = task.splits["train"]
        pairs = (task.pair(train[i]) for i in range(len(train)))
        if task.inputs == "image":  # no source text: the (unused) source tokenizer learns the captions too
            pairs = ((target, target) for _, target in pairs)
        shards = getattr(task.splits["train"], "shards", None)  # built data of our own: the vocabulary is shelved beside it
        shelf = Path(shards[0]).parent / "vocabularies" if shards else None
        settings = vocabularies.TokenizerSettings.from_config(config)
        return task, vocabularies.load_or_train(workdir / "tokenizer", settings, pairs, shelf=shelf)

    chief = jax.process_index() == 0
    if chief:
        loaded = load()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("attend: data and tokenizer ready")
    return loaded if chief else load()


# ----------------------------------------------------------------------------- one run per workdir


class WorkdirLock:
    """`workdir/.lock`, held by the run training there: an exclusive `flock` on the file, which
    holds the holder's pid and host. The kernel releases a `flock` when its process ends, however
    it ends, so a lock left by a killed run is free and simply taken over."""

    def __init__(self, handle):
        self.handle = handle

    @classmethod
    def acquire(cls, workdir: Path) -> "WorkdirLock":
        """The lock of `workdir` (which exists), or `WorkdirInUse` naming the holder; waits for nothing."""
        handle = open(workdir / ".lock", "a+")  # opening writes nothing
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "an unknown process"
            handle.close()
            raise WorkdirInUse(f"{workdir} is in use by another run ({holder}); wait for it to end, or train in another workdir")
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        handle.flush()
        return cls(handle)

    def release(self) -> None:
        if not self.handle.closed:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()


# ----------------------------------------------------------------------------- the run's config

# The fields that make a run what it is: its checkpoints, vocabulary and data only fit these.
RUN_IDENTITY = ("seed", "model", "task", "tokenizer", "data")
# The fields --mode=eval and --mode=predict may set for a run folder (data_dir: the folder moved).
EVALUATION_FIELDS = (
    "eval_split", "restore_step", "restore_best", "average_last", "decode", "eval_decode_examples",
    "length_bucket_width", "visualize_examples", "visualize_self_attention", "data_dir", "metrics",
    "coordinator_address", "num_processes", "process_id",  # how this command runs, not what the run is
)  # fmt: skip


def read_run_config(workdir: str | Path) -> ml_collections.ConfigDict | None:
    """The resolved config a run wrote to `workdir/config.json` (lists back as tuples), or None;
    completed with the common fields it lacks at their defaults, so that a run folder written
    before a field existed still resumes, evaluates and loads (`base.with_defaults`)."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(f"{path} is not a readable config ({error}); restore it or use a fresh workdir") from error
    return base.with_defaults(ml_collections.ConfigDict(_tuples(saved)))


def _tuples(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _tuples(v) for k, v in tree.items()}
    return tuple(tree) if isinstance(tree, list) else tree


def flat_fields(config: ml_collections.ConfigDict, groups: Sequence[str]) -> dict[str, Any]:
    """`{"model.d_model": 128, ...}`: the fields of `groups` (a group or a single field) by dotted name."""
    flat = {}
    for group in groups:
        value = config.get(group)
        if isinstance(value, ml_collections.ConfigDict):
            flat.update({f"{group}.{k}": v for k, v in flatten(value.to_dict()).items()})
        else:
            flat[group] = value
    return flat


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return flat


def differences(saved: ml_collections.ConfigDict, new: ml_collections.ConfigDict, groups: Sequence[str]) -> list[str]:
    """`"name: saved -> new"` for each field of `groups` that differs."""
    before, after = flat_fields(saved, groups), flat_fields(new, groups)
    return [
        f"{name}: {before.get(name, '(absent)')!r} -> {after.get(name, '(absent)')!r}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    ]


def check_resume(config: ml_collections.ConfigDict, workdir: Path) -> None:
    """A rerun on a run folder must be the same run: a changed model, task, vocabulary, data or seed
    field stops here, before anything is written. Other changes (steps, schedule, intervals,
    decoding, logging) are allowed and logged."""
    saved = read_run_config(workdir)
    if saved is None:
        return
    changed = differences(saved, config, RUN_IDENTITY)
    if changed:
        raise ConfigError(
            f"{workdir} holds a run with another config: {'; '.join(changed)}. Resume with the same "
            "model, task, tokenizer, data and seed fields, or use a fresh workdir"
        )
    other = [group for group in config if group not in RUN_IDENTITY]
    for change in differences(saved, config, other):
        logging.info("resuming with a changed field, %s", change)


def evaluation_config(
    saved: ml_collections.ConfigDict, requested: ml_collections.ConfigDict, overridden: Sequence[str]
) -> ml_collections.ConfigDict:
    """The config --mode=eval/predict runs with: the run's own (`saved`), with the evaluation fields
    of `requested` (a config file or overrides). A model, task, vocabulary, data or seed field of
    `requested` that differs from the run's stops with its name. `eval_decode_examples` (decode a
    subset) carries over only when `overridden` names it: by default the whole split is decoded."""
    changed = differences(saved, requested, RUN_IDENTITY)
    if changed:
        raise ConfigError(
            f"eval/predict read the run's config.json; these fields differ from it: {'; '.join(changed)}. "
            f"Only evaluation fields may change: {', '.join(EVALUATION_FIELDS)}"
        )
    config = ml_collections.ConfigDict(saved.to_dict())
    for name in EVALUATION_FIELDS:
        config[name] = requested[name]
    if "eval_decode_examples" not in overridden:
        config.eval_decode_examples = 0
    config.lock()
    return config


# ----------------------------------------------------------------------------- the model


def model_fields(config: ml_collections.ConfigDict, tokens: vocabularies.Tokenizers) -> dict:
    """`config.model`'s fields and the vocabulary's sizes and special ids."""
    fields = {k: v for k, v in config.model.to_dict().items() if k != "name"}
    fields.update(
        vocab_size=tokens.target.vocab_size,
        source_vocab_size=tokens.source.vocab_size,
        bos_id=vocabularies.BOS_ID,
        pad_id=vocabularies.PAD_ID,
    )
    return fields


def build_model(config: ml_collections.ConfigDict, tokens: vocabularies.Tokenizers) -> nnx.Module:
    rngs = nnx.Rngs(params=config.seed, dropout=config.seed + 1)
    return models.create_model(config.model.name, rngs=rngs, **model_fields(config, tokens))


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rngs)`; the model must hold nothing else."""
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    if jax.tree.leaves(rest):
        raise TypeError(f"the model holds state that is neither parameters nor RNG: {rest}")
    return graphdef, params, rngs


def merge_model(graphdef: nnx.GraphDef, params: nnx.State, rngs: nnx.State) -> nnx.Module:
    """The model inside a traced function. The RNG state is copied so that its Variables belong to
    this trace (NNX States hold Variables, and a closed-over one cannot be reseeded here)."""
    return nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rngs))


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Run:
    """What training, evaluation and inference share: config, data, vocabulary, devices, model, checkpoints.

    `task` is None for a run prepared without its data (inference reads only the run folder).
    """

    config: ml_collections.ConfigDict
    workdir: Path
    task: tasks.Task | None
    tokens: vocabularies.Tokenizers
    mesh: Mesh
    graphdef: nnx.GraphDef
    params: nnx.State  # the initial parameters, replicated over the mesh
    rngs: nnx.State
    checkpoints: Checkpoints
    lock: WorkdirLock | None = None  # held while training (the chief's)

    @property
    def is_chief(self) -> bool:
        return jax.process_index() == 0

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec("data"))

    def model(self, params: nnx.State) -> nnx.Module:
        """The model with `params` (inside a traced function: see `merge_model`)."""
        return merge_model(self.graphdef, params, self.rngs)

    def abstract(self, tree: Any) -> Any:
        """Shapes, dtypes and the replicated sharding of `tree`, for restoring into."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), tree)

    def global_batch(self, local: dict) -> dict:
        """Process-local numpy rows -> global arrays sharded along `data`."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local.items()}

    def pipeline(self) -> PipelineSettings:
        return PipelineSettings.from_config(self.config)

    def restore_params(self, step: int | None = None, *, best: bool = False) -> tuple[int, nnx.State]:
        """The parameters (no optimizer state) of checkpoint `step`, the best one, or the latest readable."""
        if best:
            step = self.checkpoints.best_step()
            if step is None:
                raise CheckpointError(f"no checkpoint in {self.workdir / 'checkpoints'} has eval metrics to pick the best")
        return self.checkpoints.restore_params(self.abstract(self.params), step=step)

    def averaged_params(self, last: int, up_to: int) -> tuple[list[int], nnx.State]:
        """The mean parameters of the last `last` checkpoints at or before step `up_to`."""
        steps = [s for s in self.checkpoints.steps() if s <= up_to][-last:]
        total = None
        for step in steps:
            _, params = self.checkpoints.restore_params(self.abstract(self.params), step=step)
            total = params if total is None else jax.tree.map(jnp.add, total, params)
        return steps, jax.tree.map(lambda p: p / len(steps), total)


def check_settings(config: ml_collections.ConfigDict, mesh: Mesh, *, training: bool = True) -> None:
    """What can be checked before anything is read or written: every field of the data, vocabulary,
    model and decoding settings, and how they fit together (the training memory only for `training`)."""
    base.check(config)
    tasks.check_parameters(config.task.name, **{k: v for k, v in config.task.to_dict().items() if k != "name"})
    PipelineSettings.from_config(config)
    vocabularies.TokenizerSettings.from_config(config)
    decoding.check_options(config.decode)
    if config.metrics.bleu_tokenize not in metrics.BLEU_TOKENIZERS:
        raise ConfigError(f"metrics.bleu_tokenize must be one of {', '.join(metrics.BLEU_TOKENIZERS)}, got {config.metrics.bleu_tokenize!r}")
    model = models.checked_config(config.model.name, **{k: v for k, v in config.model.to_dict().items() if k != "name"})
    check_inputs(config)
    if getattr(model, "share_embeddings", False) and not config.tokenizer.shared:
        raise ConfigError(
            "model.share_embeddings=True needs one vocabulary for source and target, but tokenizer.shared=False "
            "trains two; set tokenizer.shared=True or model.share_embeddings=False"
        )
    limit = getattr(model, "length_limit", None)
    lengths = {
        "data.max_source_length": config.data.max_source_length,
        "data.max_target_length": config.data.max_target_length,
        "data.max_source_length + decode.max_length_offset": config.data.max_source_length + config.decode.max_length_offset,
    }
    for name, length in lengths.items():
        if limit is not None and length > limit:
            raise ConfigError(f"{name} = {length} is longer than model.max_length = {limit}, the model's longest sequence")
    if training and hasattr(model, "tape_bytes"):  # LSTMN: the training step holds the tapes and their cotangents
        rows, longest = max(((rows, max(lengths)) for rows, *lengths in microbatch_shapes(config, mesh)),
                            key=lambda shape: model.tape_bytes(*shape))  # fmt: skip
        needed, available = model.tape_bytes(rows, longest), device_memory_bytes(local_device(mesh))
        if needed > available // 2:
            raise ConfigError(
                f"the LSTMN tapes of {rows} rows of up to {longest} tokens need about {needed / 2**30:.1f} GiB per "
                f"device in training, more than half of the {available / 2**30:.1f} GiB there; lower batch_size, "
                "data.max_source_length / data.max_target_length, model.hidden_dim or model.attention_dim"
            )
    check_memory(config, mesh, training=training)
    if config.batch_size % (mesh.size * config.grad_accum_steps):
        raise ConfigError(
            f"batch_size {config.batch_size} must be divisible by the {mesh.size} devices "
            f"times grad_accum_steps {config.grad_accum_steps}"
        )


def microbatch_shapes(config: ml_collections.ConfigDict, mesh: Mesh) -> list[tuple[int, int, int]]:
    """`(rows, source length, target length)` of one device's microbatch at the length limits (rows
    at least 1, before batch_size is checked); with `data.batch_tokens`, one per length bucket
    (short buckets hold more rows)."""
    data = config.data
    settings = PipelineSettings.from_config(config)
    per_device = mesh.size * config.grad_accum_steps
    if not settings.batch_tokens:
        return [(max(config.batch_size // per_device, 1), data.max_source_length, data.max_target_length)]
    return [
        (max(settings.bucket_rows(settings.padded_length(b)) // per_device, 1), min(b, data.max_source_length), min(b, data.max_target_length))
        for b in settings.bucket_boundaries
    ]


CHARACTER_VOCABULARY_GUESS = 256  # a character vocabulary's size before it is made: a few hundred at most


def check_memory(config: ml_collections.ConfigDict, mesh: Mesh, *, training: bool) -> None:
    """Huge sizes stop here, named, instead of in an allocation: the parameters (in training with
    their gradients and Adam's two moments) and one device's output logits must each fit in half
    of a device's memory. The model is built abstractly (no memory) with a vocabulary of
    `tokenizer.vocab_size` (a character vocabulary: a guess of its size)."""
    vocab = CHARACTER_VOCABULARY_GUESS if config.tokenizer.kind == "char" else config.tokenizer.vocab_size
    fields = {k: v for k, v in config.model.to_dict().items() if k != "name"}
    fields.update(vocab_size=vocab, source_vocab_size=vocab, bos_id=vocabularies.BOS_ID, pad_id=vocabularies.PAD_ID)
    count = parameter_count(config.model.name, fields)
    available = device_memory_bytes(local_device(mesh)) // 2
    copies = 4 if training else 1  # parameters, gradients, Adam's first and second moments (float32)
    if count * 4 * copies > available:
        sizes = ", ".join(f"model.{k}" for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool) and k not in models.FROM_VOCABULARY)
        raise ConfigError(
            f"model {config.model.name} has {count:,} parameters, {count * 4 * copies / 2**30:.1f} GiB with what training keeps "
            f"of them, more than half of a device's {2 * available / 2**30:.1f} GiB; lower {sizes}"
        )
    positions = max(rows * target for rows, _, target in microbatch_shapes(config, mesh))  # one device's microbatch
    logits = positions * vocab * 4 * 3  # logits, softmax and their gradient
    if logits > available:
        raise ConfigError(
            f"batch_size {config.batch_size} (with data.max_target_length {config.data.max_target_length} and "
            f"data.batch_tokens {config.data.batch_tokens}) gives each device {positions} target positions, whose output "
            f"logits alone need {logits / 2**30:.1f} GiB, more than half of its {2 * available / 2**30:.1f} GiB; "
            "lower batch_size or data.batch_tokens, or raise grad_accum_steps"
        )


def parameter_count(name: str, fields: dict) -> int:
    """The parameters of model `name` with `fields`, from abstract builds (no memory) of at most two
    layers per stack: every family's parameters grow linearly with each `num_*layers` field, and
    building dozens of layers even abstractly takes seconds each."""

    def count(**depths) -> int:
        abstract = nnx.eval_shape(lambda: models.create_model(name, rngs=nnx.Rngs(0), **{**fields, **depths}))
        return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))

    stacks = {k: v for k, v in fields.items() if k.startswith("num_") and k.endswith("layers") and v > 1}
    shallow = {k: 1 for k in stacks}
    total = shallowest = count(**shallow)
    try:
        for stack, depth in stacks.items():
            total += (depth - 1) * (count(**{**shallow, stack: 2}) - shallowest)
    except ConfigError:  # stacks that must be equally deep (Luong's): they grow together
        depth = max(stacks.values())
        total = shallowest + (depth - 1) * (count(**{k: 2 for k in stacks}) - shallowest)
    return total


def check_inputs(config: ml_collections.ConfigDict) -> None:
    """The task's sources (text or images) are what the model reads; images come in bucketed batches."""
    task_inputs = tasks.inputs_of(config.task.name)
    model_inputs = "image" if config.model.name in models.IMAGE_MODELS else "text"
    if task_inputs != model_inputs:
        raise ConfigError(
            f"task {config.task.name!r} has {task_inputs} sources, but model {config.model.name!r} reads {model_inputs}; "
            f"pair a captioning task with model.name='captioner' and a text task with a translation model"
        )
    if task_inputs == "image" and config.data.batching != "bucket":
        raise ConfigError(f"task {config.task.name!r} reads images, which do not pack; set data.batching='bucket'")


def check_task_images(task: tasks.Task, config: ml_collections.ConfigDict) -> None:
    """An image task's images have the channels the model reads (checked on the first train image)."""
    if task.inputs != "image" or config.model.get("inputs", "pixels") != "pixels":
        return
    shape = task.image(task.splits["train"][0]).shape
    if len(shape) != 3 or shape[-1] != config.model.channels:
        raise ConfigError(
            f"task {task.name}'s images have shape {shape} (height, width, channels), but model.channels = "
            f"{config.model.channels}; set model.channels={shape[-1]}"
        )


def output_length(config: ml_collections.ConfigDict, max_length_offset: int | None = None) -> int:
    """The longest decoded output: the source length plus `decode.max_length_offset` (or the one
    given), or for image sources (which have no length) `data.max_target_length`."""
    if tasks.inputs_of(config.task.name) == "image":
        return config.data.max_target_length
    offset = config.decode.max_length_offset if max_length_offset is None else max_length_offset
    return config.data.max_source_length + offset


def prepare_run(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    devices: Sequence[jax.Device] | None = None,
    *,
    with_data: bool = True,
    training: bool = True,
    lock: bool = False,
) -> Run:
    """Devices, data and vocabulary (or, `with_data=False`, the vocabulary saved in `workdir` only),
    the model with its initial parameters, and the checkpoint manager of `workdir`. With `lock`, the
    chief first takes the workdir's lock (`run.lock`; the caller releases it), after the config is
    checked and before anything in the workdir is read or written."""
    setup_distributed(config)
    mesh = make_mesh(devices)
    check_settings(config, mesh, training=training)
    workdir = Path(workdir)
    held = None
    if lock and jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        held = WorkdirLock.acquire(workdir)
    try:
        if with_data:
            workdir.mkdir(parents=True, exist_ok=True)
            task, tokens = load_task_and_tokenizers(config, workdir)
        else:
            task, tokens = None, vocabularies.load_or_train(workdir / "tokenizer", vocabularies.TokenizerSettings.from_config(config))
        graphdef, params, rngs = split_model(build_model(config, tokens))
        checkpoints = Checkpoints(
            workdir / "checkpoints",
            keep=config.keep_checkpoints,
            best_metric=config.best_metric,
            larger_is_better=config.best_metric_larger_is_better,
        )
    except BaseException:
        if held is not None:
            held.release()
        raise
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    return Run(config, workdir, task, tokens, mesh, graphdef, params, rngs, checkpoints, held)
