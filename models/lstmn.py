"""LSTMN: the Long Short-Term Memory-Network of Cheng, Dong and Lapata (2016), "Long
Short-Term Memory-Networks for Machine Reading", and its encoder-decoder (section 4).

An LSTMN keeps, instead of one state, a hidden tape `H = (h_1 .. h_{t-1})` and a
memory tape `C = (c_1 .. c_{t-1})`, read at every step by intra-attention
(section 3.1, eqs. 7-12):

    a_i^t = v^T tanh(W_h h_i + W_x x_t + W_h~ h~_{t-1})      i < t          (7)
    s^t = softmax(a^t)                                                       (8)
    h~_t = sum_i s_i^t h_i,    c~_t = sum_i s_i^t c_i                        (9)
    [i_t; f_t; o_t; c^_t] = [sigma; sigma; sigma; tanh](W [h~_t; x_t] + b)   (10)
    c_t = f_t * c~_t + i_t * c^_t                                            (11)
    h_t = o_t * tanh(c_t)                                                    (12)

`W_h h_i` does not depend on t: it is computed once, when `h_i` is written to the
tape, and kept on a third tape of keys. The tapes are fixed-size buffers carried
through a scan (`tape_scan`), written at position t and read under a mask of the
positions before t that hold a real token: one compiled program serves every
length, no step sees a later position or padding, and a padded row computes what
the example computes alone. At t = 1 the tapes are empty: `h~_1 = c~_1 = 0`.
`tape_scan`'s backward pass reads each step's tapes off the final ones instead of
keeping a copy per step, so training takes O(L) memory, not O(L^2).

The encoder-decoder (section 4, figure 3) reads the source with inter-attention
over the encoder's tapes `gamma` (hidden) and `alpha` (memory), eqs. 13-15:

    b_j^t = u^T tanh(W_gamma gamma_j + W_x x_t + W_gamma~ gamma~_{t-1})       (13)
    p^t = softmax(b^t)                                                      (14)
    gamma~_t = sum_j p_j^t gamma_j,    alpha~_t = sum_j p_j^t alpha_j        (15)

- shallow fusion (`model.fusion="shallow"`): the summary `gamma~_t` is the
  decoder's context, as RNNsearch's `c_i` is: the first decoder layer's gates read
  `[h~_t; x_t; gamma~_t]` (eq. 10 with the context appended, RNNsearch's `C c_i`);
- deep fusion (`"deep"`): the memory summary `alpha~_t` enters the first decoder
  layer's memory through a new gate (eqs. 16-17):
      r_t = sigma(W_r [gamma~_t; x_t] + b_r)                                 (16)
      c_t = r_t * alpha~_t + f_t * c~_t + i_t * c^_t                          (17)

Choices where the paper leaves room, and why:
- The paper writes eq. 13 (the inter-attention conditioned on the decoder's input
  `x_t` and the previous summary `gamma~_{t-1}`, not on a decoder state) for deep
  fusion, and says of shallow fusion only that its inter-attention works as
  Bahdanau et al.'s. We use eq. 13 for both, so that the two fusions differ only
  in where the source enters (the gates, or the memory).
- The inter-attention reads the top encoder layer's tapes, and the context or the
  fused memory enters the first decoder layer (the one whose `x_t` is the previous
  target word, as in eq. 13); layers above read the hidden outputs below.
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
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from errors import ConfigError
from models.attention import Attention, AttentionRole, AttentionWeights, capturing, masked_softmax
from models.interface import ModelConfig
from models.layers import Linear, logical, shift_right
from models.rnn import time_major

Array = jax.Array
FUSIONS = ("shallow", "deep")


@dataclasses.dataclass(frozen=True)
class LSTMNConfig(ModelConfig):
    """Hyperparameters. The paper's experiments (language modelling, sentiment analysis,
    natural language inference) use a few hundred units; the defaults here are our choice,
    with the attention size equal to the hidden size, which the paper does not give."""

    # intra-attention over the encoder's and the decoder's tapes, inter-attention over the source
    roles = frozenset({AttentionRole.SOURCE_SELF, AttentionRole.TARGET_SELF, AttentionRole.CROSS})

    vocab_size: int  # target vocabulary
    source_vocab_size: int | None = None  # None: same as vocab_size
    fusion: str = "shallow"  # "shallow" or "deep" (section 4)
    embed_dim: int = 500
    hidden_dim: int = 500
    attention_dim: int = 500  # v, W_h, W_x, W_h~ of eq. 7 and u, W_gamma, W_x, W_gamma~ of eq. 13
    num_encoder_layers: int = 1
    num_decoder_layers: int = 1
    dropout_rate: float = 0.0  # on embeddings, between layers and before the output layer
    max_length: int = 512  # the longest source, target or decoded output (eos included) the model accepts
    bos_id: int = 1
    pad_id: int = 0

    def __post_init__(self):
        if self.fusion not in FUSIONS:
            raise ConfigError(f"model.fusion must be one of {', '.join(FUSIONS)}, got {self.fusion!r}")
        for name in ("embed_dim", "hidden_dim", "attention_dim", "num_encoder_layers", "num_decoder_layers", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ConfigError(f"model.dropout_rate must be in [0, 1), got {self.dropout_rate}")

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

    hidden: Array  # h_1 .. [B, L, H]
    memory: Array  # c_1 .. [B, L, H]
    keys: Array  # W_h h_i, [B, L, A]
    written: Array  # [B, L], 1.0 where position i holds a real token's state (float, so that it has a gradient
    #                 type in `tape_scan`; it is read only as a mask)
    summary: Array  # h~_{t-1} [B, H], the previous adaptive summary (eq. 7's last term)

    @property
    def positions(self) -> tuple[Array, Array, Array, Array]:
        """The four per-position tapes, without the summary."""
        return self.hidden, self.memory, self.keys, self.written


def empty_tapes(batch: int, length: int, hidden: int, attention: int) -> Tapes:
    zeros = lambda *shape: jnp.zeros(shape)  # noqa: E731
    return Tapes(zeros(batch, length, hidden), zeros(batch, length, hidden), zeros(batch, length, attention),
                 zeros(batch, length), zeros(batch, hidden))  # fmt: skip


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
    parts = [nnx.split(module, nnx.Param, ...) for module in modules]  # the rest: capture markers, no arrays
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
    inexact = [jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves]  # the others (masks) get no gradient

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
        return ((jax.tree.map(jnp.add, d_consts[0], d_k[0]), None), d_carry, jax.tree.map(jnp.add, d_tapes, d_seen)), d_x

    length = jax.tree.leaves((xs, flags))[0].shape[0]
    start = ((jax.tree.map(jnp.zeros_like, consts[0]), None), d_carry, d_tapes)
    (d_consts, d_carry, _), d_xs = jax.lax.scan(body, start, (jnp.arange(length), xs, flags, carries, d_ys), reverse=True)
    return (d_consts[0], None), d_carry, None, d_xs, None


_tape_scan.defvjp(_tape_scan_forward, _tape_scan_backward)


class LSTMNCell(nnx.Module):
    """One LSTMN layer, eqs. 7-12 (with deep fusion's gate, eqs. 16-17, when `fused_memory`)."""

    def __init__(self, input_dim: int, hidden_dim: int, attention_dim: int, *, role: AttentionRole,
                 context_dim: int = 0, fusion_gate: bool = False, rngs: nnx.Rngs):  # fmt: skip
        """`context_dim`: the inter-attention summary's size for the first decoder layer (0 elsewhere),
        read by the gates (shallow fusion) or by the fusion gate r_t (`fusion_gate`, deep fusion)."""
        self.hidden_dim, self.attention_dim, self.role = hidden_dim, attention_dim, role
        self.key_proj = Linear(hidden_dim, attention_dim, use_bias=False, rngs=rngs)  # W_h
        self.input_attention = Linear(input_dim, attention_dim, rngs=rngs)  # W_x (and the bias inside tanh)
        self.summary_attention = Linear(hidden_dim, attention_dim, use_bias=False, rngs=rngs)  # W_h~
        self.v = nnx.Param(nnx.initializers.normal(attention_dim**-0.5)(rngs.params(), (attention_dim,)), **logical("mlp"))
        # W of eq. 10 over [h~_t; x_t] (and the context, in shallow fusion): gates i, f, o, c^
        gate_inputs = hidden_dim + input_dim + (0 if fusion_gate else context_dim)
        self.gates = Linear(gate_inputs, 4 * hidden_dim, rngs=rngs)
        self.gates.bias[...] = jnp.zeros(4 * hidden_dim).at[hidden_dim : 2 * hidden_dim].set(1.0)  # forget bias 1
        self.fusion = nnx.data(Linear(context_dim + input_dim, hidden_dim, rngs=rngs) if fusion_gate else None)  # W_r

    def intra_attention(self, tapes: Tapes, x: Array) -> tuple[Array, Array, Array]:
        """Eqs. 7-9: `(h~_t [B, H], c~_t [B, H], s^t [B, L])` over the written positions."""
        query = self.input_attention(x) + self.summary_attention(tapes.summary)  # W_x x_t + W_h~ h~_{t-1}
        scores = jnp.tanh(tapes.keys + query[:, None, :]) @ self.v[...]  # a^t [B, L]
        weights = masked_softmax(scores, tapes.written > 0)  # s^t; empty tape (t = 1): zeros
        return jnp.einsum("BL,BLH->BH", weights, tapes.hidden), jnp.einsum("BL,BLH->BH", weights, tapes.memory), weights

    def read(self, tapes: Tapes, x: Array, real: Array, *, context: Array | None = None,
             fused_memory: Array | None = None) -> tuple[tuple[Array, ...], Array, Array, Array]:  # fmt: skip
        """One step's reading of the tapes and its new state, without writing them.

        `x [B, Din]`; rows where `real [B]` is False write zeros and keep their summary.
        `context [B, Dc]`: shallow fusion's gamma~_t, read by the gates; deep fusion's too (by r_t),
        with `fused_memory` alpha~_t [B, H] (eqs. 16-17).
        Returns `(writes, summary, h_t [B, H], s^t [B, L])`: `writes` = (h_t, c_t, W_h h_t, 1) for the
        tapes' next position (zeros in padding rows), `summary` = h~_t, the next step's h~_{t-1}.
        """
        summary, memory_summary, weights = self.intra_attention(tapes, x)
        extra = [] if context is None or self.fusion is not None else [context]
        i, f, o, candidate = jnp.split(self.gates(jnp.concatenate([summary, x, *extra], axis=-1)), 4, axis=-1)
        cell = jax.nn.sigmoid(f) * memory_summary + jax.nn.sigmoid(i) * jnp.tanh(candidate)  # eq. 11
        if self.fusion is not None:  # eqs. 16-17
            cell = cell + jax.nn.sigmoid(self.fusion(jnp.concatenate([context, x], axis=-1))) * fused_memory
        hidden = jax.nn.sigmoid(o) * jnp.tanh(cell)  # eq. 12
        keep = real[:, None]
        writes = tuple(jnp.where(keep, value, 0.0) for value in (hidden, cell, self.key_proj(hidden)))  # W_h h_t, once
        writes += (real.astype(tapes.written.dtype),)
        return writes, jnp.where(keep, summary, tapes.summary), hidden, weights

    def __call__(self, tapes: Tapes, x: Array, position: Array, real: Array, **fusion) -> tuple[Tapes, Array, Array]:
        """One step that writes its state at `position`: `read`, then the writes; rows where `real [B]`
        is False leave the tapes as they were. Returns `(tapes, h_t [B, H], s^t [B, L])`."""
        writes, summary, hidden, weights = self.read(tapes, x, real, **fusion)
        written = (write_at(tape, position, value, real) for tape, value in zip(tapes.positions, writes))
        return Tapes(*written, summary), hidden, weights


class LSTMNMemory(NamedTuple):
    """What the encoder hands the decoder: the top layer's tapes, their inter-attention keys, the mask."""

    hidden: Array  # gamma_j [B, S, H]
    memory: Array  # alpha_j [B, S, H]
    keys: Array  # W_gamma gamma_j [B, S, A], computed once per source
    mask: Array  # [B, S] bool


class LSTMNDecodeState(NamedTuple):
    tapes: tuple[Tapes, ...]  # per decoder layer
    context: Array  # gamma~_{t-1} [B, H]
    position: Array  # int32, the next position to write


class LSTMN(nnx.Module):
    """The LSTMN encoder-decoder of section 4 behind the common model interface."""

    def __init__(self, config: LSTMNConfig, *, rngs: nnx.Rngs):
        self.config = config
        E, H, A = config.embed_dim, config.hidden_dim, config.attention_dim
        init = nnx.initializers.normal(stddev=0.1)
        self.source_embed = nnx.Embed(config.source_vocab_size or config.vocab_size, E, embedding_init=init, embedding_metadata=logical("vocab", "embed"), rngs=rngs)
        self.target_embed = nnx.Embed(config.vocab_size, E, embedding_init=init, embedding_metadata=logical("vocab", "embed"), rngs=rngs)
        self.encoder_cells = nnx.List(
            LSTMNCell(E if l == 0 else H, H, A, role=AttentionRole.SOURCE_SELF, rngs=rngs) for l in range(config.num_encoder_layers)
        )
        deep = config.fusion == "deep"
        self.decoder_cells = nnx.List(
            LSTMNCell(E if l == 0 else H, H, A, role=AttentionRole.TARGET_SELF, context_dim=H if l == 0 else 0,
                      fusion_gate=deep and l == 0, rngs=rngs)
            for l in range(config.num_decoder_layers)
        )  # fmt: skip
        # Inter-attention, eq. 13: keys W_gamma gamma_j (once per source), query W_x x_t + W_gamma~ gamma~_{t-1}.
        self.cross_attention = Attention(E + H, H, score="additive", attention_dim=A, role=AttentionRole.CROSS, rngs=rngs)
        self.output = Linear(2 * H, config.vocab_size, axes=("embed", "vocab"), rngs=rngs)  # over [h_t; gamma~_t]
        self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

    # -- pieces ----------------------------------------------------------------

    def _run_encoder_layer(self, cell: LSTMNCell, x: Array, mask: Array) -> Tapes:
        """One encoder layer over the whole source: `x [B, S, Din]` -> its full tapes."""
        batch, length, _ = x.shape
        rebuild, params = split_arrays(cell)

        def step(params, summary, positions, x_t, real, t):
            tapes = Tapes(*positions, summary)
            (cell_copy,) = rebuild(params)
            writes, summary, _, weights = cell_copy.read(tapes, x_t, real)
            return summary, writes, weights

        start = empty_tapes(batch, length, cell.hidden_dim, cell.attention_dim)
        summary, positions, weights = tape_scan(step, params, start.summary, start.positions, *time_major((x, mask)))
        record_intra(cell, weights)
        return Tapes(*positions, summary)

    # -- the model interface ---------------------------------------------------

    def encode(self, inputs: Array, *, deterministic: bool = True) -> LSTMNMemory:
        """`inputs [B, S]` -> the top encoder layer's tapes and their inter-attention keys."""
        mask = inputs != self.config.pad_id
        x = self.dropout(self.source_embed(inputs), deterministic=deterministic)
        for index, cell in enumerate(self.encoder_cells):
            if index > 0:
                x = self.dropout(x, deterministic=deterministic)
            tapes = self._run_encoder_layer(cell, x, mask)
            x = tapes.hidden
        return LSTMNMemory(tapes.hidden, tapes.memory, self.cross_attention.project_keys(tapes.hidden), mask)

    def init_decode_state(self, memory: LSTMNMemory, batch_size: int, max_len: int) -> LSTMNDecodeState:
        H, A = self.config.hidden_dim, self.config.attention_dim
        tapes = tuple(empty_tapes(batch_size, max_len, H, A) for _ in self.decoder_cells)
        return LSTMNDecodeState(tapes, jnp.zeros((batch_size, H)), jnp.array(0, jnp.int32))

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
        embedded = self.dropout(self.target_embed(shift_right(targets, self.config.bos_id)), deterministic=deterministic)
        real = targets != self.config.pad_id  # [B, T]
        masks = self._layer_masks(*targets.shape, deterministic)

        rebuild, params = split_arrays(self.cross_attention, *self.decoder_cells)
        deep = self.config.fusion == "deep"

        def step(consts, carry, positions, inputs, real_t, t):
            params, memory = consts
            cross_attention, *cells = rebuild(params)
            context, summaries = carry
            embedded_t, layer_masks = inputs
            tapes = tuple(Tapes(*layer, summary) for layer, summary in zip(positions, summaries))
            state = LSTMNDecodeState(tapes, context, t)
            writes, summaries, context, features, weights, intra = decoder_step(
                cells, cross_attention, deep, memory, embedded_t, state, real_t, layer_masks)  # fmt: skip
            return (context, summaries), writes, (features, weights, intra)

        start = self.init_decode_state(memory, targets.shape[0], targets.shape[1])
        carry = (start.context, tuple(tapes.summary for tapes in start.tapes))
        positions = tuple(tapes.positions for tapes in start.tapes)
        _, _, (features, weights, intra) = tape_scan(
            step, (params, memory), carry, positions, time_major((embedded, masks)), time_major(real))  # fmt: skip
        self.cross_attention.record(jnp.swapaxes(weights, 0, 1))  # [B, T, S]
        for cell, layer_weights in zip(self.decoder_cells, intra):
            record_intra(cell, layer_weights)
        features = self.dropout(jnp.swapaxes(features, 0, 1), deterministic=deterministic)
        return self._logits(features)

    def decode_step(self, memory: LSTMNMemory, token: Array, state: LSTMNDecodeState) -> tuple[Array, LSTMNDecodeState]:
        """Next-token logits: `token [B]` (the previous output, bos first) -> `(logits [B, V], state)`."""
        real = jnp.ones(token.shape, bool)
        writes, summaries, context, features, _, _ = decoder_step(
            self.decoder_cells, self.cross_attention, self.config.fusion == "deep", memory, self.target_embed(token),
            state, real, ())  # fmt: skip
        tapes = tuple(
            Tapes(*(write_at(tape, state.position, value) for tape, value in zip(tapes.positions, layer)), summary)
            for tapes, layer, summary in zip(state.tapes, writes, summaries)
        )
        return self._logits(features), LSTMNDecodeState(tapes, context, state.position + 1)

    def _logits(self, features: Array) -> Array:
        """`[..., 2H] -> [..., V]`, in float32 or wider (float64 under x64, for gradient checks)."""
        logits = self.output(features)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


def decoder_step(cells: Sequence[LSTMNCell], cross_attention: Attention, deep: bool, memory: LSTMNMemory, embedded: Array,
             state: LSTMNDecodeState, real: Array, masks: tuple) -> tuple:
    """Decoder step t of the decoder `cells` (deep fusion when `deep`), reading the tapes without writing them:

    1. inter-attention over the encoder's tapes from `x_t` (the previous word) and
       gamma~_{t-1} (eqs. 13-15): the context gamma~_t and, for deep fusion, alpha~_t;
    2. the first LSTMN layer with intra-attention over its own tapes (eqs. 7-12), reading the
       context in its gates (shallow) or gating alpha~_t into its memory (deep, eqs. 16-17);
    3. the layers above, each over its own tapes; the readout features `[h_t; gamma~_t]`.
    Returns `(writes per layer, summaries per layer, context, features [B, 2H], inter-attention
    weights [B, S], intra weights per layer)`.
    """
    query = jnp.concatenate([embedded, state.context], axis=-1)  # [x_t; gamma~_{t-1}]
    context, weights = cross_attention(query, memory.keys, memory.hidden, memory.mask)  # 1. gamma~_t
    fused = jnp.einsum("BS,BSH->BH", weights, memory.memory) if deep else None  # alpha~_t
    x, writes, summaries, intra = embedded, [], [], []
    for index, (cell, tapes) in enumerate(zip(cells, state.tapes)):
        if index > 0 and masks:
            x = x * masks[index - 1]
        arguments = dict(context=context, fused_memory=fused) if index == 0 else {}
        layer_writes, summary, x, layer_weights = cell.read(tapes, x, real, **arguments)  # 2., 3.
        writes.append(layer_writes)
        summaries.append(summary)
        intra.append(layer_weights)
    context = jnp.where(real[:, None], context, state.context)
    features = jnp.concatenate([x, context], axis=-1)
    return tuple(writes), tuple(summaries), context, features, weights, intra


def record_intra(cell: LSTMNCell, weights: Array) -> None:
    """A whole pass's intra-attention weights `[L, B, L]` (step, row, tape position) as `[B, 1, L, L]`,
    for pictures, when captured: each word's attention over the words before it, one row per word."""
    if capturing(cell):
        cell.sow(AttentionWeights, "attention_weights", jnp.swapaxes(weights, 0, 1)[:, None])
