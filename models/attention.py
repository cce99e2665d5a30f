"""Attention: score functions, masks, and the attention modules.

The score functions are those of Bahdanau et al. (2015), arXiv:1409.0473v7
(additive), Luong et al. (2015), arXiv:1508.04025v5 (dot, general, concat) and
Vaswani et al. (2017), arXiv:1706.03762v7 (scaled dot product, multi-head);
equation and section numbers below refer to these versions.

Axis names, used in every einsum and shape comment of the models package:

    B  batch                 T  target / query length    S  source / key length
    N  heads                 H  head dim                 D  model dim
    A  additive attention dim                            L  cache length

Tensors are laid out like `jax.nn.dot_product_attention`: queries `[B, T, N, H]`,
keys and values `[B, S, N, H]`. Masks are boolean, broadcastable to
`[B, N, T, S]`, True where a query may attend to a key. Attention weights are
`[B, N, T, S]`.

Masking never uses -inf: masked scores are set to a large finite negative
number before the softmax, and the weights of masked positions are set to
exactly 0 after it. A query row with nothing to attend to therefore gets all-zero
weights and a zero output, with finite gradients.

The math lives in pure functions; the modules only hold parameters. Modules
record their weights with `sow` under `AttentionWeights` while the caller
captures them (`capture_attention(model, batch)`); outside a capture they
record nothing and take the fused `jax.nn.dot_product_attention` path where it
applies. Each module carries its `AttentionRole` (what attends to what), which
`attention_roles(model)` reads without running it, so that a picture or a
metric knows the axes of the weights it is given.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import Dropout, Linear, logical

Array = jax.Array

# Finite stand-in for -inf: large enough that exp(score - max) underflows to 0,
# small enough in magnitude not to overflow float32 or bfloat16 arithmetic.
_MASKED_SCORE = -1e9

SCORES = ("scaled_dot", "dot", "general", "additive")


class AttentionWeights(nnx.Intermediate):
    """Variable type under which attention modules sow their weights."""


class AttentionRole(enum.Enum):
    """What an attention module relates: its weights' query and key axes."""

    # output positions over the source (or an image's locations): [T, S]
    CROSS = "cross"
    # source positions over the source: [S, S]
    SOURCE_SELF = "source_self"
    # output positions over earlier outputs: [T, T]
    TARGET_SELF = "target_self"


# --------------------------------------------------------------------------
# Masks


def padding_mask(query_ids: Array, key_ids: Array, pad_id: int = 0) -> Array:
    """Mask of real (non-padding) query/key pairs.

    Works on token ids or on segment ids (where 0 marks padding).

    Args:
      query_ids: `[B, T]` ids of the queries.
      key_ids: `[B, S]` ids of the keys.
    Returns:
      `[B, 1, T, S]` boolean mask.
    """
    _check_rank("query_ids", query_ids, 2)
    _check_rank("key_ids", key_ids, 2)
    query_real = query_ids != pad_id  # [B, T]
    key_real = key_ids != pad_id  # [B, S]
    return query_real[:, None, :, None] & key_real[:, None, None, :]


def causal_mask(length: int) -> Array:
    """Lower-triangular mask: query i may attend to keys j <= i.

    Returns:
      `[1, 1, T, T]` boolean mask.
    """
    positions = jnp.arange(length)
    return (positions[:, None] >= positions[None, :])[None, None]


def segment_mask(query_segment_ids: Array, key_segment_ids: Array) -> Array:
    """Packed-sequence mask: attend only within the same non-padding segment.

    Args:
      query_segment_ids: `[B, T]`, 1, 2, ... for each packed example, 0 = padding.
      key_segment_ids: `[B, S]`, same convention.
    Returns:
      `[B, 1, T, S]` boolean mask.
    """
    same_segment = query_segment_ids[:, None, :, None] == key_segment_ids[:, None, None, :]
    return same_segment & padding_mask(query_segment_ids, key_segment_ids)


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the given masks (broadcast); None entries are ignored."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    combined = present[0]
    for mask in present[1:]:
        combined = combined & mask
    return combined


# --------------------------------------------------------------------------
# Score functions: each returns `[B, N, T, S]` unnormalised scores.


def dot_scores(query: Array, key: Array) -> Array:
    """Luong et al. (2015) "dot" score, section 3.1: `score(h_t, h_s) = h_t^T h_s`.

    Args:
      query: `[B, T, N, H]`.  key: `[B, S, N, H]`.
    Returns:
      `[B, N, T, S]`.
    """
    _check_rank("query", query, 4)
    _check_rank("key", key, 4)
    return jnp.einsum("BNTH,BNSH->BNTS", heads_major(query), heads_major(key))


def heads_major(x: Array) -> Array:
    """`[B, T, N, H] -> [B, N, T, H]`.

    Why explicitly: the einsums over `[B, T, N, H]` leave XLA:CPU to transpose the
    larger `[B, N, T, S]` operands instead (a self-attention block, forward and
    backward at 64 x 128 x 256, about 5% faster this way: benchmarks/layouts.py).
    """
    return x.swapaxes(1, 2)


def general_scores(query: Array, key: Array, w: Array) -> Array:
    """Luong et al. (2015) "general" score, section 3.1: `score = h_t^T W_a h_s`.

    Args:
      query: `[B, T, N, H]`.  key: `[B, S, N, K]`.  w: `[N, H, K]`, one W_a per head.
    Returns:
      `[B, N, T, S]`.
    """
    _check_rank("query", query, 4)
    _check_rank("key", key, 4)
    _check_rank("w", w, 3)
    return jnp.einsum("BTNH,NHK,BSNK->BNTS", query, w, key)


def additive_scores(query_proj: Array, key_proj: Array, v: Array, *, query_chunk_size: int = 64) -> Array:
    """Bahdanau et al. (2015) additive score, `a(s_{i-1}, h_j)` of section 3.1 / appendix A.1.2.

    `scores[b,n,i,j] = sum_a v[n,a] * tanh(query_proj[b,i,n,a] + key_proj[b,j,n,a])`,
    i.e. `e_ij = v_a^T tanh(W_a s_{i-1} + U_a h_j)` with the projections
    `W_a s_{i-1}` and `U_a h_j` done by the caller (`U_a h_j` once per source).

    The `[B, N, T, S, A]` tanh tensor is never materialised whole: queries are
    processed `query_chunk_size` at a time, and each chunk is rematerialised in
    the backward pass, so peak memory is `B * N * chunk * S * A`, in both passes.
    Up to one chunk of queries (the RNN decoders' one query a step) the tensor is
    made directly and kept for the backward pass, like any activation: recomputing
    it would add a tanh pass to every RNNsearch step (benchmarks/step_cost_by_size.py shows
    both regimes).

    Args:
      query_proj: `[B, T, N, A]`.  key_proj: `[B, S, N, A]`.  v: `[N, A]`.
    Returns:
      `[B, N, T, S]`.
    """
    _check_rank("query_proj", query_proj, 4)
    _check_rank("key_proj", key_proj, 4)
    _check_rank("v", v, 2)
    batch, q_len, heads, dim = query_proj.shape

    def chunk_scores(query_chunk: Array) -> Array:  # [B, C, N, A] -> [B, N, C, S]
        hidden = jnp.tanh(query_chunk[:, :, None] + key_proj[:, None])  # [B, C, S, N, A]
        return jnp.einsum("BCSNA,NA->BNCS", hidden, v)

    if q_len <= query_chunk_size:
        return chunk_scores(query_proj)
    num_chunks = -(-q_len // query_chunk_size)
    padded = jnp.pad(query_proj, ((0, 0), (0, num_chunks * query_chunk_size - q_len), (0, 0), (0, 0)))
    chunks = padded.reshape(batch, num_chunks, query_chunk_size, heads, dim).swapaxes(0, 1)  # [K, B, C, N, A]
    scores = jax.lax.map(jax.checkpoint(chunk_scores), chunks)  # [K, B, N, C, S]
    scores = jnp.moveaxis(scores, 0, 2).reshape(batch, heads, num_chunks * query_chunk_size, -1)  # [B, N, K*C, S]
    return scores[:, :, :q_len]


# --------------------------------------------------------------------------
# Normalisation and the weighted sum


def masked_softmax(scores: Array, mask: Array | None) -> Array:
    """Softmax over keys in (at least) float32; masked weights exactly 0, empty rows all 0.

    Args:
      scores: `[B, N, T, S]`.  mask: broadcastable to `[B, N, T, S]`, or None.
    Returns:
      weights `[B, N, T, S]`, float32 (float64 for float64 scores).
    """
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    weights = jax.nn.softmax(jnp.where(mask, scores, _MASKED_SCORE), axis=-1)
    return jnp.where(mask, weights, 0.0)


def weighted_values(weights: Array, value: Array) -> Array:
    """`sum_j weights[b,n,i,j] * value[b,j,n,h]`: `[B, N, T, S], [B, S, N, H] -> [B, T, N, H]`."""
    return jnp.einsum("BNTS,BNSH->BNTH", weights.astype(value.dtype), heads_major(value)).swapaxes(1, 2)


def scaled_dot_product_attention(
    query: Array, key: Array, value: Array, mask: Array | None = None, *, scale: float | None = None
) -> tuple[Array, Array]:
    """Vaswani et al. (2017) eq. (1): `softmax(Q K^T * scale) V`, explicitly.

    Args:
      query: `[B, T, N, H]`.  key, value: `[B, S, N, H]`.
      mask: boolean, broadcastable to `[B, N, T, S]`; True = may attend.
      scale: defaults to `1 / sqrt(H)`.
    Returns:
      `(out [B, T, N, H], weights [B, N, T, S] float32)`.
    """
    _check_rank("value", value, 4)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    weights = masked_softmax(dot_scores(query, key) * scale, mask)
    return weighted_values(weights, value), weights


def fused_scaled_dot_product_attention(
    query: Array, key: Array, value: Array, mask: Array | None = None, *, scale: float | None = None
) -> Array:
    """Same output as `scaled_dot_product_attention`, without the weights: the library's
    kernel on accelerators (`library_scaled_dot_product_attention`), the explicit path on CPU.

    On CPU the library's einsums over `[B, T, N, H]` are the slower (see `heads_major`): a
    self-attention block, forward and backward at 64 x 128 x 256, runs about 6% faster on the
    explicit path (`benchmarks/layouts.py`; the effect on the kjv_web_transformer step:
    docs/performance.md, "What each choice is worth").

    Args and shapes as `scaled_dot_product_attention`; returns `[B, T, N, H]`.
    """
    if jax.default_backend() == "cpu":
        return scaled_dot_product_attention(query, key, value, mask, scale=scale)[0]
    return library_scaled_dot_product_attention(query, key, value, mask, scale=scale)


def library_scaled_dot_product_attention(
    query: Array, key: Array, value: Array, mask: Array | None = None, *, scale: float | None = None
) -> Array:
    """`scaled_dot_product_attention`'s output through `jax.nn.dot_product_attention`.

    cuDNN's flash attention where it applies, XLA's fused path elsewhere. Query rows
    with nothing visible are zeroed, as in the explicit path (the library would return
    the mean of the values there).

    Args and shapes as `scaled_dot_product_attention`; returns `[B, T, N, H]`.
    """
    _check_rank("query", query, 4)
    if mask is None:
        return jax.nn.dot_product_attention(query, key, value, scale=scale)
    batch, q_len, heads, _ = query.shape
    mask = jnp.broadcast_to(mask, (batch, heads, q_len, key.shape[1]))  # [B, N, T, S]
    out = jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale)
    row_visible = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]  # [B, T, N, 1]
    return jnp.where(row_visible, out, jnp.zeros_like(out))


# --------------------------------------------------------------------------
# Modules


def capturing(module: nnx.Module) -> bool:
    """Whether `module` runs inside `nnx.capture`, i.e. someone wants its weights.

    `Module.sow` outside a capture would store the value on the module, hidden
    state that outlives the call; attention modules sow only when this is True.
    (Flax marks captured modules with `__captures__`; tests/test_attention.py
    checks that this still holds.)
    """
    return hasattr(module, "__captures__")


# Decoding reads a self-attention cache in prefixes of this many positions (`attend_per_group`).
PREFIX_CHUNK = 64


class KVCache(NamedTuple):
    """Keys and values of the positions decoded so far, for incremental self-attention.

    The decoder's rows come in groups: G sources, K hypotheses of each (beam search's beams; K = 1
    for greedy search), row `g*K + k`. Each hypothesis writes its position t into its own slot k
    of the group, and a slot is never moved: when beam search reorders the hypotheses, only
    `origins` follows (`reorder_hypotheses`), not the cache.

    Laid out for `attend_per_group`, so that no step transposes or reshapes it: the group's slots
    of one position next to each other (M = L * K keys, index `t * K + j`: a step writes one
    contiguous run per row of the cache, and its product reads the array it wrote; a reshape in
    between makes XLA copy the whole cache), keys with the head dimension before the positions.

    key: `[G, N, H, L*K]`.  value: `[G, N, L*K, H]`.  origins: `[G, K, L]` int32, the slot holding
    position t of hypothesis k's prefix.  index: int32 scalar, the number of positions filled.
    """

    key: Array
    value: Array
    origins: Array
    index: Array

    def reorder_hypotheses(self, origins: Array) -> KVCache:
        """Hypothesis k of source g continues hypothesis `origins[g, k]` (`[G, K]`): it takes that
        one's slot table, and the slots stay where they are. A cache of one hypothesis per row
        (a search that repeated the memory per hypothesis) has its rows reordered instead."""
        if self.origins.shape[1] == origins.shape[1]:
            return self._replace(origins=jnp.take_along_axis(self.origins, origins[:, :, None], axis=1))
        rows = hypothesis_rows(origins)
        return KVCache(self.key[rows], self.value[rows], self.origins[rows], self.index)


def hypothesis_rows(origins: Array) -> Array:
    """The rows `[G*K]` of a `[G*K, ...]` batch that hypotheses `origins [G, K]` (indices within their
    source's group of K consecutive rows) continue."""
    groups, hypotheses = origins.shape
    return (origins + hypotheses * jnp.arange(groups)[:, None]).reshape(-1)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention with a choice of score function.

    `MultiHead(Q, K, V) = Concat(head_1..head_N) W^O`, `head_n = Attention(Q W_n^Q, K W_n^K, V W_n^V)`
    (Vaswani et al. 2017, section 3.2.2). The score per head is one of:

    - `scaled_dot`: `q.k / sqrt(H)` (Vaswani eq. 1); fused kernel when weights are not captured.
    - `dot`: `q.k` (Luong section 3.1).
    - `general`: `q^T W_n k` (Luong section 3.1), a `[H, H]` matrix per head.
    - `additive`: `v_n^T tanh(q + k)` (Bahdanau appendix A.1.2), where the query and key
      projections play the roles of `W_a` and `U_a`.

    Full sequences go through `__call__`; incremental decoding through `project_source` (once per
    source) + `attend_per_group` (cross-attention) or `init_cache` + `decode` (self-attention),
    with all state passed in and returned.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        kv_features: int | None = None,
        head_dim: int | None = None,
        out_features: int | None = None,
        score: str = "scaled_dot",
        dropout_rate: float = 0.0,
        dropout_masks: str = "packed",
        use_bias: bool = True,
        additive_chunk_size: int = 64,
        role: AttentionRole = AttentionRole.SOURCE_SELF,
        dtype: jnp.dtype | None = None,
        rngs: nnx.Rngs,
    ):
        if score not in SCORES:
            raise ValueError(f"unknown attention score {score!r}; valid: {', '.join(SCORES)}")
        if head_dim is None:
            if in_features % num_heads:
                raise ValueError(f"in_features {in_features} is not divisible by num_heads {num_heads}")
            head_dim = in_features // num_heads
        kv_features = in_features if kv_features is None else kv_features
        out_features = in_features if out_features is None else out_features
        self.num_heads, self.head_dim, self.score, self.role = num_heads, head_dim, score, role
        self.additive_chunk_size, self.dtype = additive_chunk_size, dtype
        width = num_heads * head_dim

        def projection(fan_in: int, fan_out: int, bias: bool = use_bias, axes=("embed", "heads")) -> Linear:
            return Linear(fan_in, fan_out, axes=axes, use_bias=bias, dtype=dtype, rngs=rngs)

        self.query = projection(in_features, width)
        # No key bias: it adds q.b to every score of a query, which the softmax ignores, so its
        # gradient is exactly zero and Adam would turn rounding noise into updates.
        self.key = projection(kv_features, width, bias=False)
        self.value = projection(kv_features, width)
        self.out = projection(width, out_features, axes=("heads", "embed"))
        self.dropout = Dropout(dropout_rate, masks=dropout_masks, rngs=rngs)
        self.score_weight = nnx.data(self._score_weight(score, rngs))

    def _score_weight(self, score: str, rngs: nnx.Rngs) -> nnx.Param | None:
        """`general`: one `[H, H]` matrix per head, near the identity (so it starts as `dot`);
        `additive`: the vector `v` of `v^T tanh(.)` per head, `[N, H]`."""
        shape = (self.num_heads, self.head_dim)
        if score == "general":
            eye = jnp.broadcast_to(jnp.eye(self.head_dim), shape + (self.head_dim,))
            return nnx.Param(eye + 0.02 * jax.random.normal(rngs.params(), eye.shape), **logical("heads", None, None))
        if score == "additive":
            return nnx.Param(
                nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)(rngs.params(), shape), **logical("heads", None)
            )
        return None

    def _split_heads(self, x: Array) -> Array:
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)  # [B, T, N*H] -> [B, T, N, H]

    def project_key_value(self, inputs_kv: Array) -> tuple[Array, Array]:
        """Per-head keys and values of a source, computed once: `[B, S, Dkv] -> 2 x [B, S, N, H]`."""
        return self._split_heads(self.key(inputs_kv)), self._split_heads(self.value(inputs_kv))

    def attend(
        self, inputs_q: Array, key: Array, value: Array, mask: Array | None = None, *, deterministic: bool = True
    ) -> Array:
        """Attention of new queries over projected keys/values.

        Args:
          inputs_q: `[B, T, D]`.  key, value: `[B, S, N, H]` from `project_key_value`.
          mask: broadcastable to `[B, N, T, S]`.
        Returns:
          `[B, T, Dout]`.
        """
        query = self._split_heads(self.query(inputs_q))  # [B, T, N, H]
        needs_weights = capturing(self) or (self.dropout.rate > 0 and not deterministic)
        if self.score == "scaled_dot" and not needs_weights:
            heads = fused_scaled_dot_product_attention(query, key, value, mask)
        else:
            weights = masked_softmax(self._scores(query, key), mask)  # [B, N, T, S]
            if capturing(self):
                self.sow(AttentionWeights, "attention_weights", weights)
            weights = self.dropout(weights, deterministic=deterministic)
            heads = weighted_values(weights, value)  # [B, T, N, H]
        return self.out(heads.reshape(*heads.shape[:-2], -1))  # [B, T, N*H] -> [B, T, Dout]

    def _scores(self, query: Array, key: Array) -> Array:
        if self.score == "scaled_dot":
            return dot_scores(query, key) / math.sqrt(self.head_dim)
        if self.score == "dot":
            return dot_scores(query, key)
        if self.score == "general":
            return general_scores(query, key, self.score_weight[...].astype(query.dtype))
        return additive_scores(
            query, key, self.score_weight[...].astype(query.dtype), query_chunk_size=self.additive_chunk_size
        )

    def __call__(
        self, inputs_q: Array, inputs_kv: Array | None = None, mask: Array | None = None, *, deterministic: bool = True
    ) -> Array:
        """Attention of `inputs_q [B, T, D]` over `inputs_kv [B, S, Dkv]` (self-attention if None) -> `[B, T, Dout]`."""
        key, value = self.project_key_value(inputs_q if inputs_kv is None else inputs_kv)
        return self.attend(inputs_q, key, value, mask, deterministic=deterministic)

    def init_cache(
        self, batch_size: int, max_len: int, dtype: jnp.dtype = jnp.float32, *, hypotheses: int = 1
    ) -> KVCache:
        """An empty self-attention cache for `max_len` positions of `batch_size` rows, in groups of
        `hypotheses` consecutive rows of one source."""
        if batch_size % hypotheses:
            raise ValueError(f"{batch_size} rows do not make groups of {hypotheses} hypotheses")
        groups, keys = batch_size // hypotheses, max_len * hypotheses
        key = jnp.zeros((groups, self.num_heads, self.head_dim, keys), dtype)
        value = jnp.zeros((groups, self.num_heads, keys, self.head_dim), dtype)
        origins = jnp.zeros((groups, hypotheses, max_len), jnp.int32)
        return KVCache(key, value, origins, jnp.array(0, jnp.int32))

    def decode(self, inputs_q: Array, cache: KVCache) -> tuple[Array, KVCache]:
        """Causal self-attention of every row's next position, its key and value written into the cache.

        Hypothesis k of a group attends to position t in slot `origins[g, k, t]`: its own prefix
        however the search has reordered the hypotheses (the scores of the group's other slots are
        computed and masked: cheaper than moving the cache).

        Args:
          inputs_q: `[G*K, 1, D]`, the position `cache.index` of each row.
          cache: holds positions `[0, cache.index)`.
        Returns:
          `([G*K, 1, Dout], cache holding [0, cache.index + 1))`.
        """
        groups, hypotheses, max_len = cache.origins.shape
        heads, head_dim = self.num_heads, self.head_dim
        if inputs_q.shape[:2] != (groups * hypotheses, 1):
            raise ValueError(f"decode takes one position of {groups * hypotheses} rows, got {inputs_q.shape[:2]}")
        new_key, new_value = (
            x.reshape(groups, hypotheses, heads, head_dim).astype(cache.value.dtype)
            for x in self.project_key_value(inputs_q)
        )
        zero, first = jnp.zeros((), jnp.int32), cache.index * hypotheses  # the position's run of K keys
        key = jax.lax.dynamic_update_slice(cache.key, new_key.transpose(0, 2, 3, 1), (zero, zero, zero, first))
        value = jax.lax.dynamic_update_slice(cache.value, new_value.swapaxes(1, 2), (zero, zero, first, zero))
        own_slots = jnp.broadcast_to(jnp.arange(hypotheses, dtype=jnp.int32)[None, :, None], (groups, hypotheses, 1))
        origins = jax.lax.dynamic_update_slice(cache.origins, own_slots, (zero, zero, cache.index))
        slots = jnp.arange(hypotheses)
        filled = (jnp.arange(max_len) <= cache.index)[:, None]  # [L, 1]
        visible = (origins[..., None] == slots) & filled  # [G, K, L, K (slot)]
        mask = visible.reshape(groups, 1, hypotheses, max_len * hypotheses)
        out = self.attend_per_group(inputs_q, key, value, mask, filled=cache.index + 1)
        return out, KVCache(key, value, origins, cache.index + 1)

    def project_source(self, inputs_kv: Array) -> tuple[Array, Array]:
        """A source's keys and values for decoding, once: `[G, S, Dkv] -> (key [G, N, H, S], value
        [G, N, S, H])`, in `attend_per_group`'s layouts."""
        key, value = self.project_key_value(inputs_kv)
        return key.transpose(0, 2, 3, 1), heads_major(value)

    def attend_per_group(
        self, inputs_q: Array, key: Array, value: Array, mask: Array | None, *, filled: Array | None = None
    ) -> Array:
        """One new position per row, the rows in groups of K that read the same keys and values
        (the hypotheses of one source): each group's K queries go through one product with them,
        which is read once, not once per hypothesis.

        The keys come with the head dimension before the positions: XLA:CPU's products with both
        operands in their natural layout are about 6 times faster here than with the keys'
        `[M, H]` transposed inside (that product repacks them at every call).

        Args:
          inputs_q: `[G*K, 1, D]`.  key: `[G, N, H, M]`.  value: `[G, N, M, H]`.
          mask: broadcastable to `[G, N, K, M]`, `[..., M]` in full where `filled` is given.
          filled: (a cache's) positions that may be visible, the keys `[0, filled * K)`: then
            only the first chunks of `PREFIX_CHUNK` positions that hold them are read, not all M
            keys (one branch per prefix, `lax.switch`; a search's steps move half the memory).
        Returns:
          `[G*K, 1, Dout]`.
        """
        groups = key.shape[0]
        query = self._split_heads(self.query(inputs_q)).reshape(groups, -1, self.num_heads, self.head_dim)
        query = heads_major(query)  # [G, N, K, H]
        keys, chunk = key.shape[-1], PREFIX_CHUNK * query.shape[2]
        if filled is None or keys <= chunk:
            heads = self._heads_per_group(query, key, value, mask)
        else:

            def over_prefix(size: int):
                return lambda: self._heads_per_group(query, key[..., :size], value[:, :, :size], mask[..., :size])

            prefixes = [*range(chunk, keys, chunk), keys]
            heads = jax.lax.switch((filled - 1) // PREFIX_CHUNK, [over_prefix(size) for size in prefixes])
        # the transpose to `[G, K, N, H]` is of K rows
        return self.out(heads.swapaxes(1, 2).reshape(inputs_q.shape[0], 1, -1))

    def _heads_per_group(self, query: Array, key: Array, value: Array, mask: Array | None) -> Array:
        """`attend_per_group`'s heads: query `[G, N, K, H]`, key `[G, N, H, M]`, value `[G, N, M, H]`
        -> `[G, N, K, H]`."""
        if self.score in ("scaled_dot", "dot"):
            scores = jnp.einsum("GNKH,GNHM->GNKM", query, key)
            scores = scores / math.sqrt(self.head_dim) if self.score == "scaled_dot" else scores
        else:
            # the other scores' functions take `[G, K, N, H]` and `[G, M, N, H]`
            scores = self._scores(query.swapaxes(1, 2), key.transpose(0, 3, 1, 2))
        weights = masked_softmax(scores, mask)  # [G, N, K, M]
        # an output in the operands' layout (asked for as `GKNH`, XLA:CPU makes it a transposed
        # product, 4 times slower)
        return jnp.einsum("GNKM,GNMH->GNKH", weights.astype(value.dtype), value)


class Attention(nnx.Module):
    """Single-head attention for RNN decoders: one query (the decoder state) per step.

    Scores (Bahdanau et al. 2015 appendix A.1.2; Luong et al. 2015 section 3.1):

    - `additive` (Bahdanau) / `concat` (Luong): `v^T tanh(W q + U h_j)`.
    - `dot`: `q^T h_j` (query and key sizes must match).
    - `general`: `q^T W_a h_j`.

    The key-side projection (`U h_j`, or `W_a h_j`) does not depend on the
    decoder step: `project_keys` computes it once per source and the caller
    passes it into every step. Returns the context `c_i = sum_j alpha_ij h_j`
    (Bahdanau eq. 5) and the weights `alpha_ij`; the decoder hands the weights
    of all its steps to `record` for the pictures.
    """

    def __init__(
        self,
        query_features: int,
        key_features: int,
        *,
        score: str = "additive",
        attention_dim: int | None = None,
        role: AttentionRole = AttentionRole.CROSS,
        dtype: jnp.dtype | None = None,
        rngs: nnx.Rngs,
    ):
        scores = ("additive", "concat", "dot", "general")
        if score not in scores:
            raise ValueError(f"unknown attention score {score!r}; valid: {', '.join(scores)}")
        if score == "dot" and query_features != key_features:
            raise ValueError(f"dot score needs equal query and key sizes, got {query_features} and {key_features}")
        self.score, self.role = score, role
        additive = score in ("additive", "concat")
        attention_dim = attention_dim or key_features
        self.query_proj = nnx.data(
            Linear(query_features, attention_dim, use_bias=False, dtype=dtype, rngs=rngs) if additive else None
        )
        # `general` stores W_a as a key -> query map, so that W_a h_j is a dense layer over the keys.
        key_out = attention_dim if additive else query_features
        self.key_proj = nnx.data(
            Linear(key_features, key_out, use_bias=additive, dtype=dtype, rngs=rngs) if score != "dot" else None
        )
        self.v = nnx.data(
            nnx.Param(nnx.initializers.normal(attention_dim**-0.5)(rngs.params(), (attention_dim,)), **logical("mlp"))
            if additive
            else None
        )

    def project_keys(self, keys: Array) -> Array:
        """Key-side projection, once per source: `[B, S, Dk] -> [B, S, A]` (identity for `dot`)."""
        return keys if self.key_proj is None else self.key_proj(keys)

    def __call__(
        self, query: Array, projected_keys: Array, values: Array, mask: Array | None = None
    ) -> tuple[Array, Array]:
        """One decoder step.

        Args:
          query: `[B, Dq]`, e.g. the previous decoder state `s_{i-1}`.
          projected_keys: `[B, S, A]` from `project_keys`.
          values: `[B, S, Dv]`, e.g. the annotations `h_j`.
          mask: `[B, S]` boolean, True for real source positions.
        Returns:
          `(context [B, Dv], weights [B, S])`.
        """
        _check_rank("query", query, 2)
        keys = projected_keys[:, :, None, :]  # [B, S, 1, A]
        if self.score in ("additive", "concat"):
            queries = self.query_proj(query)[:, None, None, :]  # [B, 1, 1, A]
            scores = additive_scores(queries, keys, self.v[...][None].astype(queries.dtype))
        else:
            scores = dot_scores(query[:, None, None, :], keys)  # [B, 1, 1, S]
        mask = None if mask is None else mask[:, None, None, :]  # [B, 1, 1, S]
        weights = masked_softmax(scores, mask)[:, 0, 0]  # [B, S]
        context = jnp.einsum("BS,BSD->BD", weights.astype(values.dtype), values)
        return context, weights

    def record(self, weights: Array) -> None:
        """Sows a whole pass's weights `[B, T, S]` as `[B, 1, T, S]`, when captured.

        The steps run inside a scan, where a sow cannot escape; the decoder
        stacks the steps' weights and records them once per forward pass.
        """
        if capturing(self):
            self.sow(AttentionWeights, "attention_weights", weights[:, None])


# --------------------------------------------------------------------------
# Capturing the weights


def capture_attention(model: nnx.Module, batch: Mapping[str, Any], **call_args) -> dict[str, Array]:
    """Every attention module's weights of one forward pass `model(batch, **call_args)`, by module path.

    Returns:
      e.g. `{'decoder_layers/1/cross_attention': [B, N, T, S], ...}`; `attention_roles(model)`
      tells each one's axes.
    """
    _, recorded = nnx.capture(model, AttentionWeights)(batch, **call_args)
    weights = {}
    for path, variable in nnx.to_flat_state(recorded):
        # one call of each module per forward pass
        (value,) = variable.get_value()
        weights[_path_name(path[:-1])] = value
    return weights


def attention_roles(model: nnx.Module) -> dict[str, AttentionRole]:
    """The role of every attention module of `model` (any module with an `AttentionRole` as its
    `role`, such as an LSTMN layer's intra-attention), by the module path `capture_attention` uses."""
    return {
        _path_name(path): module.role
        for path, module in nnx.iter_modules(model)
        if isinstance(getattr(module, "role", None), AttentionRole)
    }


def _path_name(path: tuple) -> str:
    return "/".join(str(part) for part in path)


def _check_rank(name: str, x: Array, rank: int) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {x.shape}")
