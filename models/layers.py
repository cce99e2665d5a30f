"""Building blocks shared by the models: embeddings, positions, feed-forward.

Axis names as in `models/attention.py` (B batch, T length, D model dim, V vocab).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.extend.random import threefry2x32_p

from utils.errors import ConfigError

Array = jax.Array

# How a dropout mask is drawn (the families' `dropout_masks` field): "packed" (`packed_keep_mask`), or
# "bernoulli" (`jax.random.bernoulli`, as `nnx.Dropout` draws it: the runs made before 2026-11-28)
DROPOUT_MASKS = ("packed", "bernoulli")


def logical(*axes: str | None) -> dict:
    """Flax NNX sharding metadata naming a parameter's axes, one logical name per axis (None: never
    split). `run_setup/sharding.py` maps the names to mesh axes, one rule table per `sharding` mode:

    - `vocab`: vocabulary rows of embeddings and output projections;
    - `embed`: the model (or embedding, or recurrent input) width that a layer reads;
    - `heads`: attention's heads (the flattened `N*H` of the projections, or `N`);
    - `mlp`: the wide side of a layer (feed-forward hidden, gates, attention dim);
    - `norm`: LayerNorm scales and biases (small: never split).

    `eager_sharding=False`: the model is built anywhere (tests, the preflight's abstract builds,
    inference on one device), with no mesh; the run places the parameters itself.
    """
    return {"out_sharding": axes, "eager_sharding": False}


class Linear(nnx.Linear):
    """`nnx.Linear` applied to the rows of its input flattened to 2-D: `[..., Din] -> [..., Dout]`.

    Same parameters and result as `nnx.Linear`. Why: XLA:CPU runs a `[B*T, Din]` matmul
    and its two gradients about 30% faster than the same dot over `[B, T, Din]`, whose
    weight gradient contracts two axes (a feed-forward block at 64 x 128 x 256, forward
    + backward: `benchmarks/layouts.py`; what it is worth to the kjv_web_transformer train
    step: docs/performance.md, "What each choice is worth").

    `axes` are the kernel's logical axis names `(in, out)` (see `logical`); the bias has `out`'s.
    """

    def __init__(
        self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None] = ("embed", "mlp"), **kwargs
    ):
        super().__init__(
            in_features, out_features, kernel_metadata=logical(*axes), bias_metadata=logical(axes[1]), **kwargs
        )

    def __call__(self, inputs: Array) -> Array:
        return super().__call__(as_rows(inputs)).reshape(*inputs.shape[:-1], self.out_features)


def as_rows(x: Array) -> Array:
    """`[..., D] -> [N, D]`, a free reshape of a row-major array."""
    return x.reshape(-1, x.shape[-1])


class Unreordered(NamedTuple):
    """Decode-state arrays that no hypothesis changes (the Transformer's cross-attention keys and
    values, one row per source, and its output table made once): beam search leaves them in place
    instead of reordering them with the hypotheses at every step (`decoding.reorder_hypotheses`)."""

    arrays: Any

    def reorder_hypotheses(self, origins: Array) -> Unreordered:
        del origins
        return self


class Embed(nnx.Module):
    """Token embedding, optionally scaled by `sqrt(D)` (Vaswani et al. 2017, section 3.4).

    `attend` reuses the same matrix as the pre-softmax projection, for models
    that share the embedding with the output layer (section 3.4 too).
    """

    def __init__(self, vocab_size: int, features: int, *, scale: bool = True, dtype=None, rngs: nnx.Rngs):
        # Unit-variance rows: with the sqrt(D) scale the inputs have the size of
        # the sinusoidal positions, and as output weights the logits start O(1).
        init = nnx.initializers.normal(stddev=features**-0.5)
        self.embedding = nnx.Embed(
            vocab_size,
            features,
            embedding_init=init,
            dtype=dtype,
            embedding_metadata=logical("vocab", "embed"),
            rngs=rngs,
        )
        self.multiplier = math.sqrt(features) if scale else 1.0

    def __call__(self, tokens: Array) -> Array:
        """`[B, T] int -> [B, T, D]`."""
        return self.embedding(tokens) * self.multiplier

    def attend(self, x: Array, table: Array | None = None) -> Array:
        """Logits against every embedding row: `[B, T, D] -> [B, T, V]` (one 2-D matmul, see `Linear`).

        `table`: `output_table()`, made once for many calls (a decoding's steps), else made here.
        """
        if table is None:
            table = self.output_table()
        rows, table = self.embedding.promote_dtype((as_rows(x), table), dtype=self.embedding.dtype)
        return jnp.dot(rows, table).reshape(*x.shape[:-1], self.embedding.num_embeddings)

    def output_table(self) -> Array:
        """The embedding as the output projection's `[D, V]` kernel, in the compute dtype.

        Why a decoding makes it once (`Transformer.init_decode_state`): XLA:CPU's product with a
        `[V, D]` operand contracted on its last axis transposes that operand at every call, which
        doubled a decoding step's output projection (8 rows: 196 -> 93 us; docs/performance.md,
        "Against the strongest peers"). Inside one compiled product, as in training, XLA folds the transpose away.
        The price: a second copy of the table while a search runs (V x D in the compute dtype).
        """
        (table,) = self.embedding.promote_dtype((self.embedding.embedding[...],), dtype=self.embedding.dtype)
        return table.T


def sinusoidal_encoding(positions: Array, features: int, max_timescale: float = 10_000.0) -> Array:
    """Vaswani et al. (2017) section 3.5.

    `PE(pos, 2i) = sin(pos / 10000^(2i/D))`, `PE(pos, 2i+1) = cos(pos / 10000^(2i/D))`,
    the sines and cosines interleaved as in the paper's formula.

    Args:
      positions: `[..., T]` integer positions (restarting per packed segment).
    Returns:
      float32 `[..., T, D]`.
    """
    if features % 2:
        raise ValueError(f"sinusoidal encoding needs an even model dim, got {features}")
    # the 2i of the formula
    even_dims = jnp.arange(0, features, 2, dtype=jnp.float32)
    inverse_wavelengths = max_timescale ** (-even_dims / features)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inverse_wavelengths  # [..., T, D/2]
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*angles.shape[:-1], features)


class LearnedPositions(nnx.Module):
    """Learned absolute position embeddings (the alternative of Vaswani et al. table 3, row E)."""

    def __init__(self, max_length: int, features: int, *, dtype=None, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        self.embedding = nnx.Embed(
            max_length, features, embedding_init=init, dtype=dtype, embedding_metadata=logical(None, "embed"), rngs=rngs
        )
        self.max_length = max_length

    def __call__(self, positions: Array) -> Array:
        """`[..., T] int -> [..., T, D]`."""
        return self.embedding(positions)


class FeedForward(nnx.Module):
    """Position-wise feed-forward network, Vaswani et al. (2017) eq. (2).

    `FFN(x) = max(0, x W1 + b1) W2 + b2`, with optional dropout on the ReLU output.
    """

    def __init__(
        self,
        features: int,
        hidden: int,
        *,
        dropout_rate: float = 0.0,
        dropout_masks: str = "packed",
        dtype=None,
        rngs: nnx.Rngs,
    ):
        self.inner = Linear(features, hidden, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.outer = Linear(hidden, features, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.dropout = Dropout(dropout_rate, masks=dropout_masks, rngs=rngs)

    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        """`[B, T, D] -> [B, T, D]`."""
        hidden = self.dropout(jax.nn.relu(self.inner(x)), deterministic=deterministic)
        return self.outer(hidden)


def check_dropout(config: Any, *rates: str) -> None:
    """A family's dropout fields: each of `rates` (field names) in [0, 1), `dropout_masks` one of
    `DROPOUT_MASKS`."""
    for name in rates:
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(config, name)}")
    if config.dropout_masks not in DROPOUT_MASKS:
        raise ConfigError(
            f"model.dropout_masks must be one of {', '.join(DROPOUT_MASKS)}, got {config.dropout_masks!r}"
        )


def packed_keep_mask(key: Array, keep: float, shape: tuple[int, ...]) -> tuple[Array, float]:
    """`(mask bool[shape], p)`: each entry True with probability `p`, `keep` rounded to a multiple
    of 2^-16 (0.9 -> 0.899994), independently; `p` is what the kept entries are divided by.

    Each entry is a 16-bit uniform integer compared with `round(keep * 2^16)`, four entries from
    each Threefry-2x32 block (two 32-bit words). `jax.random.bernoulli` spends a whole block on
    every entry (in JAX's partitionable mode it folds the two words into one) and turns it into a
    float: on this 2-core CPU the kjv_web_transformer step's 36M residual-dropout entries took
    0.43 s of a 2.5 s step that way, 0.11 s this way (docs/performance.md, "What each choice is
    worth"). A block's counter is its index in the `[..., ceil(last / 4)]` grid, made from iotas
    as JAX's partitionable draws are (elementwise, no sequential state to split across devices).
    """
    threshold = round(keep * 2**16)
    if not 0 < threshold <= 2**16:
        raise ValueError(f"keep probability {keep} rounds to {threshold} / 2^16: not a dropout")
    *lead, last = shape
    blocks = (*lead, -(-last // 4))
    if math.prod(blocks) >= 2**32:
        raise ValueError(f"dropout over {shape} needs more than 2^32 blocks")
    index = jnp.zeros(blocks, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(blocks))):
        index = index + lax.broadcasted_iota(jnp.uint32, blocks, axis) * jnp.uint32(stride)
        stride *= blocks[axis]
    key_words = jax.random.key_data(key)
    high, low = threefry2x32_p.bind(key_words[0], key_words[1], jnp.zeros_like(index), index)
    draws = jnp.stack([high & 0xFFFF, high >> 16, low & 0xFFFF, low >> 16], axis=-1)
    return draws.reshape(*lead, -1)[..., :last] < threshold, threshold / 2**16


class Dropout(nnx.Dropout):
    """`nnx.Dropout` (the same `rate`, `deterministic`, `dropout` stream and `nnx.reseed`), its mask
    drawn as `masks` says: "packed" (`packed_keep_mask`; kept entries divided by the rounded keep
    probability in the input's dtype, as `nnx.Dropout` divides by its own, so in float32 the
    expectation stays the input), or "bernoulli" (`nnx.Dropout`'s own draw). A key of another PRNG
    than Threefry (`jax_default_prng_impl`) draws as "bernoulli"."""

    def __init__(self, rate: float, *, masks: str = "packed", rngs: nnx.Rngs):
        if masks not in DROPOUT_MASKS:
            raise ValueError(f"dropout masks must be one of {', '.join(DROPOUT_MASKS)}, got {masks!r}")
        super().__init__(rate, rngs=rngs)
        self.masks = masks

    def __call__(self, inputs: Array, *, deterministic: bool | None = None) -> Array:
        deterministic = self.deterministic if deterministic is None else deterministic
        if self.masks == "bernoulli" or self.rate == 0.0 or deterministic:
            return super().__call__(inputs, deterministic=deterministic)
        key = self.rngs()
        if str(jax.random.key_impl(key)) != "threefry2x32":
            return super().__call__(inputs, deterministic=deterministic, rngs=key)
        mask, keep = packed_keep_mask(key, 1.0 - self.rate, inputs.shape)
        return lax.select(mask, inputs / jnp.asarray(keep, inputs.dtype), jnp.zeros_like(inputs))


def layer_norm(features: int, *, dtype=None, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm (Ba et al. 2016) with float32 statistics and parameters."""
    return nnx.LayerNorm(
        features,
        epsilon=1e-6,
        dtype=dtype,
        param_dtype=jnp.float32,
        scale_metadata=logical("norm"),
        bias_metadata=logical("norm"),
        rngs=rngs,
    )


def shift_right(targets: Array, bos_id: int, segment_ids: Array | None = None) -> Array:
    """Teacher-forcing decoder inputs: `[bos, y_1, ..., y_{T-1}]` per row (or per packed segment).

    Args:
      targets: `[B, T]` int.
      segment_ids: `[B, T]`, packed-segment ids; each segment starts with bos.
    Returns:
      `[B, T]` int.
    """
    shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]  # [B, T]
    if segment_ids is None:
        return shifted
    previous_segment = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]  # [B, T]
    return jnp.where(segment_ids != previous_segment, bos_id, shifted)
