"""LSTMN: the Long Short-Term Memory-Network of Cheng, Dong and Lapata (2016), "Long
Short-Term Memory-Networks for Machine Reading", arXiv:1601.06733v7, and its
encoder-decoder (section 4). Equation and section numbers here are v7's.

An LSTMN keeps, instead of one state, a hidden tape `H = (h_1 .. h_{t-1})` and a
memory tape `C = (c_1 .. c_{t-1})`, read at every step by intra-attention
(section 3.2, eqs. 4-9):

    a_i^t = v^T tanh(W_h h_i + W_x x_t + W_h~ h~_{t-1})      i < t          (4)
    s^t = softmax(a^t)                                                       (5)
    h~_t = sum_i s_i^t h_i,    c~_t = sum_i s_i^t c_i                        (6)
    [i_t; f_t; o_t; c^_t] = [sigma; sigma; sigma; tanh](W [h~_t; x_t] + b)   (7)
    c_t = f_t * c~_t + i_t * c^_t                                            (8)
    h_t = o_t * tanh(c_t)                                                    (9)

In a stack, layer k+1 reads layer k's `h_t` where the first layer reads `x_t` (eq. 10).

`W_h h_i` does not depend on t: it is computed once, when `h_i` is written to the
tape, and kept on a third tape of keys. The tapes are fixed-size buffers carried
through a scan (`tape_scan`), written at position t and read under a mask of the
positions before t that hold a real token: one compiled program serves every
length, no step sees a later position or padding, and a padded row computes what
the example computes alone. At t = 1 the tapes are empty: `h~_1 = c~_1 = 0`.
`tape_scan`'s backward pass reads each step's tapes off the final ones instead of
keeping a copy per step, so training takes O(L) memory, not O(L^2).

The encoder-decoder (section 4, figure 3) reads the source with inter-attention
over the encoder's tapes `gamma` (hidden) and `alpha` (memory), eqs. 11-13:

    b_j^t = u^T tanh(W_gamma gamma_j + W_x x_t + W_gamma~ gamma~_{t-1})       (11)
    p^t = softmax(b^t)                                                      (12)
    gamma~_t = sum_j p_j^t gamma_j,    alpha~_t = sum_j p_j^t alpha_j        (13)

- shallow fusion (`model.fusion="shallow"`): the summary `gamma~_t` is the
  decoder's context, as RNNsearch's `c_i` is: the first decoder layer's gates read
  `[h~_t; x_t; gamma~_t]` (eq. 7 with the context appended, RNNsearch's `C c_i`).
  Its inter-attention is "similar to" Bahdanau et al.'s (section 4), whose query is
  the decoder's previous state; by default (`model.inter_query="previous_state"`)
  eq. 11's query terms are replaced by that state, the top decoder layer's `h_{t-1}`:
      b_j^t = u^T tanh(W_gamma gamma_j + W_s h_{t-1})                         (11')
  (`h_0` = 0, or the top decoder layer's seed under `model.seed_tapes`);
- deep fusion (`"deep"`): the memory summary `alpha~_t` enters the first decoder
  layer's memory through a new gate (eqs. 14-15; `h_t = o_t * tanh(c_t)` of this `c_t` is eq. 16):
      r_t = sigma(W_r [gamma~_t; x_t] + b_r)                                 (14)
      c_t = r_t * alpha~_t + f_t * c~_t + i_t * c^_t                          (15)

Choices where the paper leaves room, and why:
- The inter-attention's query (`model.inter_query`). The paper writes eq. 11 (conditioned on
  the decoder's input `x_t`, the previous output word, and the previous summary `gamma~_{t-1}`,
  not on a decoder state) for deep fusion, and says of shallow fusion only that its
  inter-attention works as Bahdanau et al.'s, whose query is the decoder's previous state. So
  shallow fusion defaults to eq. 11' above ("previous_state") and deep fusion keeps eq. 11
  ("word_and_context"); shallow fusion with eq. 11 is there for comparison (it does not learn
  to copy long sources: docs/experiments.md, the length experiment). Deep fusion with Bahdanau's query is
  refused: the paper gives deep fusion eq. 11 alone. `gamma~_{t-1}` is not added to eq. 11':
  Bahdanau's query has no such term, and no measurement of ours shows that it helps.
- The tapes' first state (`model.seed_tapes`). The paper starts every tape empty: at t = 1
  nothing is read and `h~_1 = c~_1 = 0` (default, `False`). The authors' released code
  (github.com/cheng6076/SNLI-attention, LSTMN.lua with model/encoder_lstmn_w2v.lua and
  model/decoder_deep_w2v.lua) does otherwise (`True`): the encoder's tapes start with a
  zero slot `h_0 = c_0 = 0`, which its intra-attention and the decoder's inter-attention
  read like any other position (a place to put weight that reads nothing), and the
  decoder's tapes start with the encoder's final hidden and memory state, so that step 1
  reads `h~_1 = h_m`, `c~_1 = c_m` and the gradient reaches the encoder's last state through
  the decoder's tapes. That code has one layer each; here decoder layer l starts with the
  final state of encoder layer l (the layer counts must then be equal). The paper's variant
  is the default: it is what the paper specifies, with Bahdanau's query it copies long
  sources better than the seeded tapes under the same budget (docs/experiments.md, the length
  experiment: 1.0 against 0.94 at 30-39 symbols, 0.91 against 0.08 at 80-89), and it keeps
  existing runs' tapes as they were. Pictures and recorded weights leave the first slots out, so that they stay aligned
  with the tokens.
- The inter-attention reads the top encoder layer's tapes, and the context or the
  fused memory enters the first decoder layer (the one whose `x_t` is the previous
  target word, as in eq. 11); layers above read the hidden outputs below (eq. 10).
- The output layer reads `[h_t; gamma~_t]` (the top decoder layer's hidden state and
  the context) in both fusions, as RNNsearch's deep output reads `s_i` and `c_i`;
  the paper does not give its output layer.
- No bidirectional encoder: an LSTMN's tapes hold the tokens read so far, and the
  paper's encoder reads left to right; a backward LSTMN would be a second model
  with its own tapes, which the paper does not describe.

Axes: B batch, S source length, T target length, E embedding, H hidden (per
layer), A attention dim, V vocabulary. Sources and targets are right-padded;
rows hold one example each (`data.batching="bucket"`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention, AttentionRole, AttentionWeights, capturing, masked_softmax
from models.interface import ModelConfig
from models.layers import Dropout, Linear, check_dropout, logical, shift_right
from models.rnn import time_major
from utils.errors import ConfigError

Array = jax.Array
FUSIONS = ("shallow", "deep")
# eq. 11' (Bahdanau's query) and eq. 11
INTER_QUERIES = ("previous_state", "word_and_context")


@dataclasses.dataclass(frozen=True)
class LSTMNConfig(ModelConfig):
    """Hyperparameters. The paper's experiments (language modelling, sentiment analysis,
    natural language inference) use a few hundred units; the defaults here are our choice,
    with the attention size equal to the hidden size, which the paper does not give."""

    # intra-attention over the encoder's and the decoder's tapes, inter-attention over the source
    roles = frozenset({AttentionRole.SOURCE_SELF, AttentionRole.TARGET_SELF, AttentionRole.CROSS})
    # runs saved before `inter_query` existed used eq. 11 in both fusions
    fields_before = {**ModelConfig.fields_before, "inter_query": "word_and_context"}
    # "eq13": the value's name in runs saved before the equations were numbered as v7 numbers them
    renamed_values = {"inter_query": {"eq13": "word_and_context"}}

    # target vocabulary
    vocab_size: int
    # None: same as vocab_size
    source_vocab_size: int | None = None
    # "shallow" or "deep" (section 4)
    fusion: str = "shallow"
    # Inter-attention's query: "previous_state" (eq. 11', Bahdanau's: the top decoder layer's previous
    # hidden state) or "word_and_context" (eq. 11's [x_t; gamma~_{t-1}]: the previous output word and the
    # previous inter-attention summary); None: the fusion's own, "previous_state" for shallow fusion,
    # "word_and_context" for deep fusion (the only one the paper gives it). See the module docstring.
    inter_query: str | None = None
    # The tapes' first state: False, the paper's empty tapes (h~_1 = c~_1 = 0); True, the authors' released
    # code's: a zero slot first on the encoder's tapes, the decoder's seeded with the encoder's final state.
    seed_tapes: bool = False
    embed_dim: int = 500
    hidden_dim: int = 500
    # v, W_h, W_x, W_h~ of eq. 4 and u, W_gamma, W_x, W_gamma~ of eq. 11
    attention_dim: int = 500
    num_encoder_layers: int = 1
    num_decoder_layers: int = 1
    # on embeddings, between layers and before the output layer
    dropout_rate: float = 0.0
    # how dropout masks are drawn: "packed" or "bernoulli" (models/layers.py, `DROPOUT_MASKS`)
    dropout_masks: str = "packed"
    # the longest source, target or decoded output (eos included) the model accepts
    max_length: int = 512
    bos_id: int = 1
    pad_id: int = 0

    def __post_init__(self):
        if self.fusion not in FUSIONS:
            raise ConfigError(f"model.fusion must be one of {', '.join(FUSIONS)}, got {self.fusion!r}")
        if self.inter_query is not None and self.inter_query not in INTER_QUERIES:
            raise ConfigError(
                f"model.inter_query must be one of {', '.join(INTER_QUERIES)} or None, got {self.inter_query!r}"
            )
        if self.fusion == "deep" and self.query == "previous_state":
            raise ConfigError(
                "model.inter_query='previous_state' is shallow fusion's query; "
                "deep fusion's is eq. 11's ('word_and_context')"
            )
        if self.seed_tapes and self.num_encoder_layers != self.num_decoder_layers:
            raise ConfigError(
                f"model.seed_tapes seeds decoder layer l with encoder layer l's final state: "
                f"num_encoder_layers ({self.num_encoder_layers}) must equal num_decoder_layers "
                f"({self.num_decoder_layers})"
            )
        for name in (
            "embed_dim",
            "hidden_dim",
            "attention_dim",
            "num_encoder_layers",
            "num_decoder_layers",
            "max_length",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        check_dropout(self, "dropout_rate")

    @property
    def query(self) -> str:
        """The inter-attention's query, `inter_query` resolved: one of `INTER_QUERIES`."""
        if self.inter_query is not None:
            return self.inter_query
        return "word_and_context" if self.fusion == "deep" else "previous_state"

    @property
    def length_limit(self) -> int:
        """The longest sequence the tapes hold."""
        return self.max_length

    def tape_bytes(self, batch: int, length: int) -> int:
        """Memory the training step needs for the tapes: per encoder and decoder layer, three tapes
        of `[batch, length, hidden or attention]` (and the written mask) three times over (the
        values, the copy a step reads in the backward pass, the cotangents; see `tape_scan`), and
        every step's attention weights over the tape, `[length, batch, length]`, twice (values,
        cotangents). Float32. Calibrated against XLA's memory analysis of the compiled gradient:
        64 rows of 128 tokens at width 128 take 0.16 GB in all, of which this counts 0.09 GB (the
        rest is the vocabulary's logits)."""
        tapes = 3 * batch * length * (2 * self.hidden_dim + self.attention_dim + 1) * 4
        weights = 2 * batch * length * length * 4
        return (self.num_encoder_layers + self.num_decoder_layers) * (tapes + weights)


class Tapes(NamedTuple):
    """One LSTMN layer's memory of the tokens read so far (written at `position`)."""

    # h_1 .. [B, L, H]
    hidden: Array
    # c_1 .. [B, L, H]
    memory: Array
    # W_h h_i, [B, L, A]
    keys: Array
    # [B, L], 1.0 where position i holds a real token's state (float, so that it has a gradient type in
    # `tape_scan`; it is read only as a mask)
    written: Array
    # h~_{t-1} [B, H], the previous adaptive summary (eq. 4's last term)
    summary: Array

    @property
    def positions(self) -> tuple[Array, Array, Array, Array]:
        """The four per-position tapes, without the summary."""
        return self.hidden, self.memory, self.keys, self.written


def empty_tapes(batch: int, length: int, hidden: int, attention: int) -> Tapes:
    zeros = lambda *shape: jnp.zeros(shape)  # noqa: E731
    return Tapes(
        zeros(batch, length, hidden),
        zeros(batch, length, hidden),
        zeros(batch, length, attention),
        zeros(batch, length),
        zeros(batch, hidden),
    )


def write_at(tape: Array, position: Array, value: Array, real: Array | None = None) -> Array:
    """`tape [B, L, ...]` with `value [B, ...]` written at `position` (in the rows where `real [B]`, when
    given; the others keep what they held). An in-place update of one position, not a select over the
    whole tape, so that writing costs O(H) per step rather than O(L H)."""
    if real is not None:
        current = jax.lax.dynamic_index_in_dim(tape, position, axis=1, keepdims=False)  # [B, ...]
        value = jnp.where(real.reshape(real.shape + (1,) * (value.ndim - 1)), value, current)
    return jax.lax.dynamic_update_index_in_dim(tape, value.astype(tape.dtype), position, axis=1)


def split_arrays(*modules: nnx.Module) -> tuple[Callable[[list[Array]], tuple[nnx.Module, ...]], list[Array]]:
    """The parameters of `modules` as a list of arrays, and the function that rebuilds the modules
    from it: what `tape_scan`'s step reads must be an argument (a custom VJP cannot close over
    traced values). Each module is split alone: under `nnx.capture`, a list of modules gets a
    string key beside its int ones, which `nnx.split` cannot sort."""
    # the rest: capture markers, no arrays
    parts = [nnx.split(module, nnx.Param, ...) for module in modules]
    leaves, treedef = jax.tree.flatten([params for _, params, _ in parts])

    def rebuild(arrays: list[Array]) -> tuple[nnx.Module, ...]:
        states = jax.tree.unflatten(treedef, arrays)
        return tuple(nnx.merge(graphdef, params, rest) for (graphdef, _, rest), params in zip(parts, states))

    return rebuild, leaves


def tape_scan(step: Callable, consts: Any, carry: Any, tapes: Any, xs: Any, flags: Any) -> tuple[Any, Any, Any]:
    """A scan whose steps each write once to fixed-size tapes and read what the earlier steps wrote.

    `step(consts, carry, tapes, x, flag, t) -> (carry, writes, y)`: step t reads `tapes` (a pytree of
    `[B, L, ...]` arrays) at positions `< t` only (later positions hold zeros when it runs) and returns
    `writes` (`[B, ...]` leaves), written at position t. `xs` and `flags` are scanned over their
    leading axis; `flags` get no gradient. `tapes` must start as zeros; they get no gradient either.
    Returns `(carry, tapes, ys)`, the final carry and tapes and the stacked `y`s.

    Why not `lax.scan` with the tapes in its carry: its backward pass keeps every step's carry,
    `L` copies of `[B, L, ...]` tapes, O(L^2) memory and as much traffic. A tape position never
    changes once written, so the backward pass here (a reverse scan) reads step t's tapes off the
    final ones (positions `< t`) and keeps only the small per-step carries; the tapes' cotangents
    accumulate in one `[B, L, ...]` buffer, complete at position t by the time step t is reached,
    since only later steps read it. Memory O(L), and each step's work is recomputed once.
    """
    leaves, treedef = jax.tree.flatten(consts)
    # the others (masks) get no gradient
    inexact = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]

    def step_on_parts(parts, carry, tapes, x, flag, t):
        differentiable, fixed = iter(parts[0]), iter(parts[1])
        consts = jax.tree.unflatten(treedef, [next(differentiable) if i else next(fixed) for i in inexact])
        return step(consts, carry, tapes, x, flag, t)

    parts = ([leaf for leaf, i in zip(leaves, inexact) if i], [leaf for leaf, i in zip(leaves, inexact) if not i])
    return _tape_scan(step_on_parts, parts, carry, tapes, xs, flags)


def _visible(tapes: Any, t: Array) -> Any:
    """`tapes` with positions `>= t` zeroed: what step t saw when it ran."""

    def mask(tape):
        before = jnp.arange(tape.shape[1]) < t
        return jnp.where(before.reshape((1, -1) + (1,) * (tape.ndim - 2)), tape, 0)

    return jax.tree.map(mask, tapes)


def _scan(step, consts, carry, tapes, xs, flags):
    """The forward pass of `tape_scan`, also returning each step's incoming carry."""

    def body(state, inputs):
        carry, tapes = state
        t, x, flag = inputs
        new_carry, writes, y = step(consts, carry, tapes, x, flag, t)
        tapes = jax.tree.map(lambda tape, value: write_at(tape, t, value), tapes, writes)
        return (new_carry, tapes), (y, carry)

    length = jax.tree.leaves((xs, flags))[0].shape[0]
    (carry, tapes), (ys, carries) = jax.lax.scan(body, (carry, tapes), (jnp.arange(length), xs, flags))
    return carry, tapes, ys, carries


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tape_scan(step, consts, carry, tapes, xs, flags):
    return _scan(step, consts, carry, tapes, xs, flags)[:3]


def _tape_scan_forward(step, consts, carry, tapes, xs, flags):
    carry, tapes, ys, carries = _scan(step, consts, carry, tapes, xs, flags)
    return (carry, tapes, ys), (consts, tapes, xs, flags, carries)


def _tape_scan_backward(step, residuals, cotangents):
    consts, final_tapes, xs, flags, carries = residuals
    d_carry, d_tapes, d_ys = cotangents

    def body(state, inputs):
        d_consts, d_carry, d_tapes = state
        t, x, flag, carry, d_y = inputs
        seen = _visible(final_tapes, t)
        _, step_vjp = jax.vjp(lambda k, c, v, x: step(k, c, v, x, flag, t), consts, carry, seen, x)
        d_writes = jax.tree.map(lambda d: jax.lax.dynamic_index_in_dim(d, t, axis=1, keepdims=False), d_tapes)
        d_k, d_carry, d_seen, d_x = step_vjp((d_carry, d_writes, d_y))
        return (
            (jax.tree.map(jnp.add, d_consts[0], d_k[0]), None),
            d_carry,
            jax.tree.map(jnp.add, d_tapes, d_seen),
        ), d_x

    length = jax.tree.leaves((xs, flags))[0].shape[0]
    start = ((jax.tree.map(jnp.zeros_like, consts[0]), None), d_carry, d_tapes)
    (d_consts, d_carry, _), d_xs = jax.lax.scan(
        body, start, (jnp.arange(length), xs, flags, carries, d_ys), reverse=True
    )
    return (d_consts[0], None), d_carry, None, d_xs, None


_tape_scan.defvjp(_tape_scan_forward, _tape_scan_backward)


class LSTMNCell(nnx.Module):
    """One LSTMN layer, eqs. 4-9 (with deep fusion's gate, eqs. 14-15, when `fused_memory`)."""

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int,
        attention_dim: int,
        *,
        role: AttentionRole,
        context_dim: int = 0,
        fusion_gate: bool = False,
        rngs: nnx.Rngs,
    ):
        """`context_dim`: the inter-attention summary's size for the first decoder layer (0 elsewhere),
        read by the gates (shallow fusion) or by the fusion gate r_t (`fusion_gate`, deep fusion)."""
        self.hidden_dim, self.attention_dim, self.role = hidden_dim, attention_dim, role
        # W_h
        self.key_proj = Linear(hidden_dim, attention_dim, use_bias=False, rngs=rngs)
        # W_x (and the bias inside tanh)
        self.input_attention = Linear(input_dim, attention_dim, rngs=rngs)
        # W_h~
        self.summary_attention = Linear(hidden_dim, attention_dim, use_bias=False, rngs=rngs)
        self.v = nnx.Param(
            nnx.initializers.normal(attention_dim**-0.5)(rngs.params(), (attention_dim,)), **logical("mlp")
        )
        # W of eq. 7 over [h~_t; x_t] (and the context, in shallow fusion): gates i, f, o, c^
        gate_inputs = hidden_dim + input_dim + (0 if fusion_gate else context_dim)
        self.gates = Linear(gate_inputs, 4 * hidden_dim, rngs=rngs)
        # forget bias 1
        self.gates.bias[...] = jnp.zeros(4 * hidden_dim).at[hidden_dim : 2 * hidden_dim].set(1.0)
        # W_r
        self.fusion = nnx.data(Linear(context_dim + input_dim, hidden_dim, rngs=rngs) if fusion_gate else None)

    def intra_attention(
        self, tapes: Tapes, x: Array, first: tuple[Array, Array] | None = None
    ) -> tuple[Array, Array, Array]:
        """Eqs. 4-6: `(h~_t [B, H], c~_t [B, H], s^t [B, L])` over the written positions, and over the
        tape's first slot `first = (h_0 [B, H], c_0 [B, H])` when given (`seed_tapes`). The first slot is
        read beside the tape, not copied into it, and its weight is left out of the `s^t` returned."""
        # W_x x_t + W_h~ h~_{t-1}
        query = self.input_attention(x) + self.summary_attention(tapes.summary)
        # a^t [B, L]
        scores = jnp.tanh(tapes.keys + query[:, None, :]) @ self.v[...]
        written = tapes.written > 0
        if first is None:
            # s^t; empty tape (t = 1): zeros
            weights = masked_softmax(scores, written)
            return (
                jnp.einsum("BL,BLH->BH", weights, tapes.hidden),
                jnp.einsum("BL,BLH->BH", weights, tapes.memory),
                weights,
            )
        h_0, c_0 = first
        # a_0^t [B]
        score_0 = jnp.tanh(self.key_proj(h_0) + query) @ self.v[...]
        with_first = jnp.pad(written, ((0, 0), (1, 0)), constant_values=True)  # [B, 1 + L]: the first slot always
        everything = masked_softmax(jnp.concatenate([score_0[:, None], scores], 1), with_first)
        weight_0, weights = everything[:, :1], everything[:, 1:]  # [B, 1], [B, L]
        h_tilde = weight_0 * h_0 + jnp.einsum("BL,BLH->BH", weights, tapes.hidden)
        c_tilde = weight_0 * c_0 + jnp.einsum("BL,BLH->BH", weights, tapes.memory)
        return h_tilde, c_tilde, weights

    def read(
        self,
        tapes: Tapes,
        x: Array,
        real: Array,
        *,
        context: Array | None = None,
        fused_memory: Array | None = None,
        first: tuple[Array, Array] | None = None,
    ) -> tuple[tuple[Array, ...], Array, Array, Array]:
        """One step's reading of the tapes and its new state, without writing them.

        `x [B, Din]`; rows where `real [B]` is False write zeros and keep their summary.
        `context [B, Dc]`: shallow fusion's gamma~_t, read by the gates; deep fusion's too (by r_t),
        with `fused_memory` alpha~_t [B, H] (eqs. 14-15). `first`: the tape's first slot, see
        `intra_attention`.
        Returns `(writes, summary, h_t [B, H], s^t [B, L])`: `writes` = (h_t, c_t, W_h h_t, 1) for the
        tapes' next position (zeros in padding rows), `summary` = h~_t, the next step's h~_{t-1}.
        """
        summary, memory_summary, weights = self.intra_attention(tapes, x, first)
        extra = [] if context is None or self.fusion is not None else [context]
        i, f, o, candidate = jnp.split(self.gates(jnp.concatenate([summary, x, *extra], axis=-1)), 4, axis=-1)
        # eq. 8
        cell = jax.nn.sigmoid(f) * memory_summary + jax.nn.sigmoid(i) * jnp.tanh(candidate)
        # eqs. 14-15
        if self.fusion is not None:
            cell = cell + jax.nn.sigmoid(self.fusion(jnp.concatenate([context, x], axis=-1))) * fused_memory
        # eq. 9 (eq. 16 under deep fusion)
        hidden = jax.nn.sigmoid(o) * jnp.tanh(cell)
        keep = real[:, None]
        # W_h h_t, once
        writes = tuple(jnp.where(keep, value, 0.0) for value in (hidden, cell, self.key_proj(hidden)))
        writes += (real.astype(tapes.written.dtype),)
        return writes, jnp.where(keep, summary, tapes.summary), hidden, weights

    def __call__(self, tapes: Tapes, x: Array, position: Array, real: Array, **fusion) -> tuple[Tapes, Array, Array]:
        """One step that writes its state at `position`: `read`, then the writes; rows where `real [B]`
        is False leave the tapes as they were. Returns `(tapes, h_t [B, H], s^t [B, L])`."""
        writes, summary, hidden, weights = self.read(tapes, x, real, **fusion)
        written = (write_at(tape, position, value, real) for tape, value in zip(tapes.positions, writes))
        return Tapes(*written, summary), hidden, weights


class LSTMNMemory(NamedTuple):
    """What the encoder hands the decoder: the top layer's tapes, their inter-attention keys, the mask;
    with `seed_tapes`, the zero slot first (S' = S + 1) and the decoder's first slots."""

    # gamma_j [B, S', H]
    hidden: Array
    # alpha_j [B, S', H]
    memory: Array
    # W_gamma gamma_j [B, S', A], computed once per source
    keys: Array
    mask: Array  # [B, S'] bool
    # per decoder layer, its tapes' first slot (h_0, c_0) [B, H], each encoder layer l's final state
    # (seed_tapes), or ()
    first: tuple[tuple[Array, Array], ...] = ()


class LSTMNDecodeState(NamedTuple):
    # per decoder layer
    tapes: tuple[Tapes, ...]
    # gamma~_{t-1} [B, H]
    context: Array
    # int32, the next position to write
    position: Array
    # the top decoder layer's h_{t-1} [B, H], the query of eq. 11'
    hidden: Array


class LSTMN(nnx.Module):
    """The LSTMN encoder-decoder of section 4 behind the common model interface."""

    def __init__(self, config: LSTMNConfig, *, rngs: nnx.Rngs):
        self.config = config
        E, H, A = config.embed_dim, config.hidden_dim, config.attention_dim
        init = nnx.initializers.normal(stddev=0.1)
        self.source_embed = nnx.Embed(
            config.source_vocab_size or config.vocab_size,
            E,
            embedding_init=init,
            embedding_metadata=logical("vocab", "embed"),
            rngs=rngs,
        )
        self.target_embed = nnx.Embed(
            config.vocab_size, E, embedding_init=init, embedding_metadata=logical("vocab", "embed"), rngs=rngs
        )
        self.encoder_cells = nnx.List(
            LSTMNCell(E if layer == 0 else H, H, A, role=AttentionRole.SOURCE_SELF, rngs=rngs)
            for layer in range(config.num_encoder_layers)
        )
        deep = config.fusion == "deep"
        self.decoder_cells = nnx.List(
            LSTMNCell(
                E if layer == 0 else H,
                H,
                A,
                role=AttentionRole.TARGET_SELF,
                context_dim=H if layer == 0 else 0,
                fusion_gate=deep and layer == 0,
                rngs=rngs,
            )
            for layer in range(config.num_decoder_layers)
        )
        # Inter-attention: keys W_gamma gamma_j (once per source); query W_x x_t + W_gamma~ gamma~_{t-1} (eq. 11)
        # or W_s h_{t-1} (eq. 11')
        query_dim = E + H if config.query == "word_and_context" else H
        self.cross_attention = Attention(
            query_dim, H, score="additive", attention_dim=A, role=AttentionRole.CROSS, rngs=rngs
        )
        # over [h_t; gamma~_t]
        self.output = Linear(2 * H, config.vocab_size, axes=("embed", "vocab"), rngs=rngs)
        self.dropout = Dropout(config.dropout_rate, masks=config.dropout_masks, rngs=rngs)

    # -- pieces ----------------------------------------------------------------

    def _run_encoder_layer(self, cell: LSTMNCell, x: Array, mask: Array) -> Tapes:
        """One encoder layer over the whole source: `x [B, S, Din]` -> its full tapes (without the zero
        slot that `seed_tapes` reads first)."""
        batch, length, _ = x.shape
        rebuild, params = split_arrays(cell)
        zero_slot = self.config.seed_tapes

        def step(params, summary, positions, x_t, real, t):
            tapes = Tapes(*positions, summary)
            (cell_copy,) = rebuild(params)
            # h_0 = c_0 = 0
            first = (jnp.zeros_like(summary), jnp.zeros_like(summary)) if zero_slot else None
            writes, summary, _, weights = cell_copy.read(tapes, x_t, real, first=first)
            return summary, writes, weights

        start = empty_tapes(batch, length, cell.hidden_dim, cell.attention_dim)
        summary, positions, weights = tape_scan(step, params, start.summary, start.positions, *time_major((x, mask)))
        record_intra(cell, weights)
        return Tapes(*positions, summary)

    # -- the model interface ---------------------------------------------------

    def encode(self, inputs: Array, *, deterministic: bool = True) -> LSTMNMemory:
        """`inputs [B, S]` -> the top encoder layer's tapes and their inter-attention keys; with
        `seed_tapes`, the zero slot first (`[B, S + 1, ...]`) and every layer's final state."""
        mask = inputs != self.config.pad_id
        x = self.dropout(self.source_embed(inputs), deterministic=deterministic)
        finals = []
        for index, cell in enumerate(self.encoder_cells):
            if index > 0:
                x = self.dropout(x, deterministic=deterministic)
            tapes = self._run_encoder_layer(cell, x, mask)
            finals.append(final_state(tapes, mask))
            x = tapes.hidden
        hidden, memory = tapes.hidden, tapes.memory
        if not self.config.seed_tapes:
            return LSTMNMemory(hidden, memory, self.cross_attention.project_keys(hidden), mask)
        zero_slot = lambda tape: jnp.pad(tape, ((0, 0), (1, 0), (0, 0)))  # noqa: E731  gamma_0 = alpha_0 = 0
        hidden, memory, mask = (
            zero_slot(hidden),
            zero_slot(memory),
            jnp.pad(mask, ((0, 0), (1, 0)), constant_values=True),
        )
        return LSTMNMemory(hidden, memory, self.cross_attention.project_keys(hidden), mask, tuple(finals))

    def init_decode_state(self, memory: LSTMNMemory, batch_size: int, max_len: int) -> LSTMNDecodeState:
        """Empty tapes; the previous state h_0 of eq. 11' is the top decoder layer's first slot when seeded, else 0."""
        H, A = self.config.hidden_dim, self.config.attention_dim
        tapes = tuple(empty_tapes(batch_size, max_len, H, A) for _ in self.decoder_cells)
        hidden = memory.first[-1][0] if memory.first else jnp.zeros((batch_size, H))
        return LSTMNDecodeState(tapes, jnp.zeros((batch_size, H)), jnp.array(0, jnp.int32), hidden)

    def _layer_masks(self, batch: int, length: int, deterministic: bool) -> tuple[Array, ...]:
        """Dropout masks `[B, T, H]` for the inputs of decoder layers 2.. (scaled; empty when deterministic)."""
        if deterministic or self.config.dropout_rate == 0.0:
            return ()
        ones = jnp.ones((batch, length, self.config.hidden_dim))
        return tuple(self.dropout(ones, deterministic=False) for _ in self.decoder_cells[1:])

    def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
        """Teacher-forced logits `[B, T, V]` for `batch['targets']` given `batch['inputs']`."""
        if "inputs_segment_ids" in batch:
            raise ConfigError("LSTMN does not read packed rows; set data.batching='bucket'")
        targets = batch["targets"]
        memory = self.encode(batch["inputs"], deterministic=deterministic)
        embedded = self.dropout(
            self.target_embed(shift_right(targets, self.config.bos_id)), deterministic=deterministic
        )
        real = targets != self.config.pad_id  # [B, T]
        masks = self._layer_masks(*targets.shape, deterministic)

        rebuild, params = split_arrays(self.cross_attention, *self.decoder_cells)
        config = self.config

        def step(consts, carry, positions, inputs, real_t, t):
            params, memory = consts
            cross_attention, *cells = rebuild(params)
            context, summaries, hidden = carry
            embedded_t, layer_masks = inputs
            tapes = tuple(Tapes(*layer, summary) for layer, summary in zip(positions, summaries))
            state = LSTMNDecodeState(tapes, context, t, hidden)
            writes, summaries, context, hidden, features, weights, intra = decoder_step(
                cells, cross_attention, config, memory, embedded_t, state, real_t, layer_masks
            )
            return (context, summaries, hidden), writes, (features, weights, intra)

        start = self.init_decode_state(memory, targets.shape[0], targets.shape[1])
        carry = (start.context, tuple(tapes.summary for tapes in start.tapes), start.hidden)
        positions = tuple(tapes.positions for tapes in start.tapes)
        _, _, (features, weights, intra) = tape_scan(
            step, (params, memory), carry, positions, time_major((embedded, masks)), time_major(real)
        )
        self.cross_attention.record(jnp.swapaxes(weights, 0, 1)[..., self.first_column :])  # [B, T, S], no zero slot
        for cell, layer_weights in zip(self.decoder_cells, intra):
            record_intra(cell, layer_weights)
        features = self.dropout(jnp.swapaxes(features, 0, 1), deterministic=deterministic)
        return self._logits(features)

    def decode_step(self, memory: LSTMNMemory, token: Array, state: LSTMNDecodeState) -> tuple[Array, LSTMNDecodeState]:
        """Next-token logits: `token [B]` (the previous output, bos first) -> `(logits [B, V], state)`."""
        real = jnp.ones(token.shape, bool)
        writes, summaries, context, hidden, features, _, _ = decoder_step(
            self.decoder_cells, self.cross_attention, self.config, memory, self.target_embed(token), state, real, ()
        )
        tapes = tuple(
            Tapes(*(write_at(tape, state.position, value) for tape, value in zip(tapes.positions, layer)), summary)
            for tapes, layer, summary in zip(state.tapes, writes, summaries)
        )
        return self._logits(features), LSTMNDecodeState(tapes, context, state.position + 1, hidden)

    @property
    def first_column(self) -> int:
        """Where the source's tokens start in the memory: 1 after `seed_tapes`' zero slot, else 0."""
        return int(self.config.seed_tapes)

    def _logits(self, features: Array) -> Array:
        """`[..., 2H] -> [..., V]`, in float32 or wider (float64 under x64, for gradient checks)."""
        logits = self.output(features)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


def decoder_step(
    cells: Sequence[LSTMNCell],
    cross_attention: Attention,
    config: LSTMNConfig,
    memory: LSTMNMemory,
    embedded: Array,
    state: LSTMNDecodeState,
    real: Array,
    masks: tuple,
) -> tuple:
    """Decoder step t of the decoder `cells`, reading the tapes without writing them:

    1. inter-attention over the encoder's tapes (eqs. 12-13) from `config.query`'s query: eq. 11's
       `[x_t; gamma~_{t-1}]` (x_t the previous word) or eq. 11' `h_{t-1}` (the top layer's previous
       state): the context gamma~_t and, for deep fusion, alpha~_t;
    2. the first LSTMN layer with intra-attention over its own tapes (eqs. 4-9), reading the
       context in its gates (shallow) or gating alpha~_t into its memory (deep, eqs. 14-15);
    3. the layers above, each over its own tapes (eq. 10); the readout features `[h_t; gamma~_t]`.
    Each layer's tapes start with `memory.first`'s slot where it has one (`seed_tapes`).
    Returns `(writes per layer, summaries per layer, context, the top layer's h_t [B, H], features
    [B, 2H], inter-attention weights [B, S'], intra weights per layer)`.
    """
    if config.query == "word_and_context":
        query = jnp.concatenate([embedded, state.context], axis=-1)  # [x_t; gamma~_{t-1}], eq. 11
    else:
        # h_{t-1}, eq. 11'
        query = state.hidden
    # 1. gamma~_t
    context, weights = cross_attention(query, memory.keys, memory.hidden, memory.mask)
    # alpha~_t
    fused = jnp.einsum("BS,BSH->BH", weights, memory.memory) if config.fusion == "deep" else None
    firsts = memory.first or (None,) * len(cells)
    x, writes, summaries, intra = embedded, [], [], []
    for index, (cell, tapes, first) in enumerate(zip(cells, state.tapes, firsts)):
        if index > 0 and masks:
            x = x * masks[index - 1]
        arguments = dict(context=context, fused_memory=fused) if index == 0 else {}
        # 2., 3.
        layer_writes, summary, x, layer_weights = cell.read(tapes, x, real, first=first, **arguments)
        writes.append(layer_writes)
        summaries.append(summary)
        intra.append(layer_weights)
    keep = real[:, None]
    context, hidden = jnp.where(keep, context, state.context), jnp.where(keep, x, state.hidden)
    features = jnp.concatenate([x, context], axis=-1)
    return tuple(writes), tuple(summaries), context, hidden, features, weights, intra


def final_state(tapes: Tapes, mask: Array) -> tuple[Array, Array]:
    """A layer's state after the last real token of each row: `(h_m, c_m)`, each `[B, H]`, from its tapes
    `[B, S, H]` and the source mask `[B, S]` (an empty row's position 0 holds zeros: it reads zeros)."""
    last = jnp.maximum(mask.sum(axis=1) - 1, 0)[:, None, None]  # [B, 1, 1]
    pick = lambda tape: jnp.take_along_axis(tape, last, axis=1)[:, 0]  # noqa: E731
    return pick(tapes.hidden), pick(tapes.memory)


def record_intra(cell: LSTMNCell, weights: Array) -> None:
    """A whole pass's intra-attention weights `[L, B, L]` (step, row, tape position) as `[B, 1, L, L]`,
    for pictures, when captured: each word's attention over the words before it, one row per word."""
    if capturing(cell):
        cell.sow(AttentionWeights, "attention_weights", jnp.swapaxes(weights, 0, 1)[:, None])
