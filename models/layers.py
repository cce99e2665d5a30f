"""Building blocks shared by the models: embeddings, positions, feed-forward.

Axis names as in `models/attention.py` (B batch, T length, D model dim, V vocab).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array


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


class PerSource(NamedTuple):
    """Decode-state arrays of a source that no hypothesis changes (the Transformer's
    cross-attention keys and values): beam search leaves them in place instead of
    reordering them with the hypotheses at every step (`decoding.reorder_hypotheses`)."""

    arrays: Any

    def reorder_hypotheses(self, origins: Array) -> PerSource:
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

    def attend(self, x: Array) -> Array:
        """Logits against every embedding row: `[B, T, D] -> [B, T, V]` (one 2-D matmul, see `Linear`)."""
        return self.embedding.attend(as_rows(x)).reshape(*x.shape[:-1], self.embedding.num_embeddings)


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

    def __init__(self, features: int, hidden: int, *, dropout_rate: float = 0.0, dtype=None, rngs: nnx.Rngs):
        self.inner = Linear(features, hidden, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.outer = Linear(hidden, features, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        """`[B, T, D] -> [B, T, D]`."""
        hidden = self.dropout(jax.nn.relu(self.inner(x)), deterministic=deterministic)
        return self.outer(hidden)


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
