"""Where parameters and optimizer state live: one rule table per `sharding` mode maps the models'
logical axis names to the axes of the (`data`, `model`) mesh.

Every parameter names its axes through Flax NNX's own sharding metadata (`out_sharding`, set by
`models.layers.logical`: the feed-forward's inner kernel is `('embed', 'mlp')`, an embedding
`('vocab', 'embed')`). `nnx.get_partition_spec` under `nnx.logical_axis_rules(rules(mode))` turns
the names into `PartitionSpec`s over the mesh:

- `replicated`: every device holds everything (every name maps to None);
- `fsdp`: `embed` along `data`, so each large matrix is split over all devices (ZeRO-3); XLA
  gathers a layer's weights where it is used;
- `fsdp_tp`: `embed` along `data`, and `heads`, `mlp` and `vocab` along `model` (Megatron style).

A dimension that its mesh axis does not divide stays whole (replicated along that axis), and
`partition_specs` says which. Adam's moments are shaped like the parameters and get their
shardings (`optimizer_shardings`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from utils.errors import ConfigError

# the mesh's axes: batch rows (and fsdp's shards), tensor parallelism
DATA, MODEL = "data", "model"
# models.layers.logical documents each
LOGICAL_AXES = ("vocab", "embed", "heads", "mlp", "norm")
# a name absent from a mode's table is never split
RULES: dict[str, dict[str, str]] = {
    "replicated": {},
    "fsdp": {"embed": DATA},
    "fsdp_tp": {"embed": DATA, "heads": MODEL, "mlp": MODEL, "vocab": MODEL},
}


def rules(mode: str) -> tuple[tuple[str, str | None], ...]:
    """`mode`'s table as `nnx.logical_axis_rules` takes it, every logical name listed (Flax passes an
    unlisted name through as a mesh axis)."""
    return tuple((name, RULES[mode].get(name)) for name in LOGICAL_AXES)


def mesh_shape(device_count: int, mode: str, tensor_parallel: int) -> tuple[int, int]:
    """`(data, model)` axis sizes: `model` is `tensor_parallel` (1 but for fsdp_tp), `data` the rest.

    Raises:
      ConfigError: `tensor_parallel` does not divide the device count, naming both.
    """
    model = tensor_parallel if mode == "fsdp_tp" else 1
    if device_count % model:
        raise ConfigError(
            f"tensor_parallel {tensor_parallel} does not divide the {device_count} devices; "
            f"pick a divisor of {device_count}"
        )
    return device_count // model, model


def partition_specs(abstract_params: Any, mesh: Mesh, mode: str, *, log: bool = True) -> Any:
    """The `PartitionSpec` of each parameter (a tree shaped like `abstract_params`, an nnx.State of
    arrays or `ShapeDtypeStruct`s) under `mode`'s rules; a dimension its mesh axis does not divide
    stays whole, and (`log`) the start-up log names it."""
    with nnx.logical_axis_rules(rules(mode)):
        specs = nnx.get_partition_spec(abstract_params)
    undivided: list[str] = []

    def fit(path, spec: PartitionSpec, leaf) -> PartitionSpec:
        axes = list(spec)
        for i, axis in enumerate(axes):
            size = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis or ()))
            if leaf.shape[i] % size:
                name = jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
                undivided.append(f"{name} dim {i} ({leaf.shape[i]}) by {axis} ({size})")
                axes[i] = None
        return PartitionSpec(*axes)

    fitted = jax.tree_util.tree_map_with_path(
        fit, specs, abstract_params, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    if log and undivided:
        logging.info("sharding %s: kept whole (the mesh axis does not divide them): %s", mode, "; ".join(undivided))
    return fitted


def is_replicated(specs: Any) -> bool:
    """Whether no spec of the tree names a mesh axis: every device holds everything."""
    return not any(
        any(axis is not None for axis in spec)
        for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    )


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def without_data_axis(shardings: Any) -> Any:
    """`shardings` (a tree of `NamedSharding`s) with the `data` axis dropped from every spec: fsdp's
    shards whole, tensor parallel's `model` split kept."""

    def drop(axis):
        kept = tuple(name for name in ((axis,) if isinstance(axis, str) else axis or ()) if name != DATA)
        return kept[0] if len(kept) == 1 else kept or None

    return jax.tree.map(
        lambda s: NamedSharding(s.mesh, PartitionSpec(*map(drop, s.spec))),
        shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def optimizer_shardings(
    tx: optax.GradientTransformation, params: Any, param_shardings: Any, replicated: NamedSharding
) -> Any:
    """The shardings of `tx.init(params)`: each parameter-shaped leaf (Adam's moments) that of its
    parameter, everything else (step counts) replicated."""
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def abstract_with_shardings(abstract: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s of `abstract` with `shardings` (a tree of the same shape): what a sharded
    array would be, without its memory."""
    return jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract, shardings
    )


def bytes_per_device(tree: Any) -> int:
    """The bytes one device holds of `tree` (arrays or `ShapeDtypeStruct`s with shardings): its shard
    of each leaf (the largest shard, where they differ)."""
    return sum(
        int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)
    )


def memory_line(mesh: Mesh, mode: str, params: Any, opt_state: Any) -> str:
    """One start-up line: the mode, the mesh, and the parameter and optimizer bytes per device."""
    mib = lambda tree: bytes_per_device(tree) / 2**20  # noqa: E731
    shape = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return (
        f"sharding {mode} over ({shape}): parameters {mib(params):.2f} MiB "
        f"and optimizer state {mib(opt_state):.2f} MiB per device"
    )
