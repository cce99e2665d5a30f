"""What is checked before anything is read or written, beyond the settings' own checks: whether the
batch splits over the devices, and whether the model and its batches fit in a device's memory."""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

import models
from run_setup.cluster import device_memory_bytes
from run_setup.settings import Settings
from tasks import vocabularies
from utils.errors import ConfigError

# a character vocabulary's size before it is made: a few hundred at most
CHARACTER_VOCABULARY_GUESS = 256


def check(settings: Settings, mesh: Mesh, memory: int | None = None, *, training: bool = True) -> None:
    """The checks that need the devices (the training memory only for `training`); `memory` is one
    device's (`cluster.device_memory_bytes`, asked here if not given)."""
    memory = device_memory_bytes(mesh) if memory is None else memory
    hyperparameters = settings.model.hyperparameters
    # LSTMN: the training step holds the tapes and their cotangents (0 bytes for the others)
    if training:
        rows, longest = max(
            ((rows, max(lengths)) for rows, *lengths in microbatch_shapes(settings, mesh)),
            key=lambda shape: hyperparameters.tape_bytes(*shape),
        )
        needed, available = hyperparameters.tape_bytes(rows, longest), memory
        if needed and needed > available // 2:
            raise ConfigError(
                f"the LSTMN tapes of {rows} rows of up to {longest} tokens need about {needed / 2**30:.1f} GiB per "
                f"device in training, more than half of the {available / 2**30:.1f} GiB there; lower batch_size, "
                "data.max_source_length / data.max_target_length, model.hidden_dim or model.attention_dim"
            )
    check_memory(settings, mesh, memory, training=training)
    batch_size, accumulate = settings.optimization.batch_size, settings.optimization.grad_accum_steps
    if batch_size % (mesh.size * accumulate):
        raise ConfigError(
            f"batch_size {batch_size} must be divisible by the {mesh.size} devices times grad_accum_steps {accumulate}"
        )


def microbatch_shapes(settings: Settings, mesh: Mesh) -> list[tuple[int, int, int]]:
    """`(rows, source length, target length)` of one device's microbatch at the length limits (rows
    at least 1, before batch_size is checked); with `data.batch_tokens`, one per length bucket
    (short buckets hold more rows)."""
    data = settings.data
    per_device = mesh.size * settings.optimization.grad_accum_steps
    if not data.batch_tokens:
        return [(max(data.batch_size // per_device, 1), data.max_source_length, data.max_target_length)]
    return [
        (
            max(data.bucket_rows(data.padded_length(b)) // per_device, 1),
            min(b, data.max_source_length),
            min(b, data.max_target_length),
        )
        for b in data.bucket_boundaries
    ]


def check_memory(settings: Settings, mesh: Mesh, memory: int, *, training: bool) -> None:
    """Huge sizes stop here, named, instead of in an allocation: the parameters (in training with
    their gradients and Adam's two moments) and one device's output logits must each fit in half
    of a device's memory. The model is built abstractly (no memory) with a vocabulary of
    `tokenizer.vocab_size` (a character vocabulary: a guess of its size)."""
    tokenizer, model = settings.tokenizer, settings.model
    vocab = CHARACTER_VOCABULARY_GUESS if tokenizer.kind == "char" else tokenizer.vocab_size
    fields = {
        **model.fields,
        "vocab_size": vocab,
        "source_vocab_size": vocab,
        "bos_id": vocabularies.BOS_ID,
        "pad_id": vocabularies.PAD_ID,
    }
    count = parameter_count(model.name, fields)
    available = memory // 2
    # parameters, gradients, Adam's first and second moments (float32)
    copies = 4 if training else 1
    # fsdp and fsdp_tp split the large parameters (nearly all bytes) over every device of the mesh
    shards = 1 if settings.cluster.sharding == "replicated" else mesh.size
    per_device = count * 4 * copies // shards
    if per_device > available:
        sizes = ", ".join(
            f"model.{k}"
            for k, v in fields.items()
            if isinstance(v, int) and not isinstance(v, bool) and k not in models.FROM_VOCABULARY
        )
        raise ConfigError(
            f"model {model.name} has {count:,} parameters, {per_device / 2**30:.1f} GiB per device "
            f"with what training keeps of them (sharding {settings.cluster.sharding}), "
            f"more than half of a device's {2 * available / 2**30:.1f} GiB; "
            f"lower {sizes}{'' if shards > 1 else ', or shard them: sharding=fsdp'}"
        )
    # one device's microbatch
    positions = max(rows * target for rows, _, target in microbatch_shapes(settings, mesh))
    # logits, softmax and their gradient
    logits = positions * vocab * 4 * 3
    if logits > available:
        data = settings.data
        raise ConfigError(
            f"batch_size {data.batch_size} (with data.max_target_length {data.max_target_length} and "
            f"data.batch_tokens {data.batch_tokens}) gives each device {positions} target positions, whose output "
            f"logits alone need {logits / 2**30:.1f} GiB, more than half of its {2 * available / 2**30:.1f} GiB; "
            "lower batch_size or data.batch_tokens, or raise grad_accum_steps"
        )


def parameter_count(name: str, fields: dict) -> int:
    """The parameters of model `name` with `fields`, from abstract builds (no memory) of at most two
    layers per stack: every family's parameters grow linearly with each `num_*layers` field, and
    building dozens of layers even abstractly takes seconds each."""

    def count(**depths) -> int:
        return abstract_parameter_count(name, hashable({**fields, **depths}))

    stacks = {k: v for k, v in fields.items() if k.startswith("num_") and k.endswith("layers") and v > 1}
    shallow = {k: 1 for k in stacks}
    total = shallowest = count(**shallow)
    try:
        for stack, depth in stacks.items():
            total += (depth - 1) * (count(**{**shallow, stack: 2}) - shallowest)
    except ConfigError:
        # stacks that must be equally deep (Luong's): they grow together
        depth = max(stacks.values())
        total = shallowest + (depth - 1) * (count(**{k: 2 for k in stacks}) - shallowest)
    return total


@functools.cache
def abstract_parameter_count(name: str, fields: tuple) -> int:
    """The parameters of model `name` built abstractly with `fields` (`hashable`'s items): a pure
    function of its arguments, kept for the process, since every run set up in it (a resume, an
    evaluation, the Python API) checks its model again and tracing the build is most of the check."""
    abstract = nnx.eval_shape(lambda: models.create_model(name, rngs=nnx.Rngs(0), **dict(fields)))
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def hashable(fields: dict) -> tuple:
    """`fields` as sorted `(name, value)` items, lists made tuples (a cache key; a model's sequence
    fields take either)."""
    return tuple(sorted((key, tuple(value) if isinstance(value, list) else value) for key, value in fields.items()))
