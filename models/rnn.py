"""Recurrent encoder-decoders: RNNencdec, RNNsearch and Luong attention.

- RNNencdec: Cho et al. (2014), "Learning Phrase Representations using RNN
  Encoder-Decoder for Statistical Machine Translation", arXiv:1406.1078v3: the
  encoder's summary `c` is the decoder's only view of the source, at every step.
- RNNsearch: Bahdanau, Cho and Bengio (2015), "Neural Machine Translation by
  Jointly Learning to Align and Translate", arXiv:1409.0473v7: a bidirectional
  encoder and additive attention over its annotations.
- Luong: Luong, Pham and Manning (2015), "Effective Approaches to
  Attention-based Neural Machine Translation", arXiv:1508.04025v5: global
  attention with dot, general or concat scores, the attentional state and
  input feeding.

All three share one teacher-forced pass (`RNNEncoderDecoder.__call__`) and
one `decode_step`, so the decoder in `scoring/decoding.py` serves them unchanged.
Recurrences run in `jax.lax.scan`; whatever does not depend on the previous
state is computed outside it, once per sequence: the input projections of
the embeddings, the key projection `U h_j` of the source, and the output
layer over all positions. Dropout (Zaremba et al. 2014) is on the
non-recurrent connections only: embeddings, between layers and before the
output layer; the masks between decoder layers are drawn before the scan.

Axes: B batch, S source length, T target length, E embedding, H hidden,
V vocabulary. Sources and targets are right-padded with `pad_id` (these
models do not read packed rows: use `data.batching="bucket"`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention, AttentionRole
from models.interface import ModelConfig
from models.layers import Dropout, Linear, check_dropout, logical, shift_right
from utils.errors import ConfigError

Array = jax.Array
CELLS = ("gru", "lstm")
# Luong et al. section 3.1's content-based scores
LUONG_SCORES = ("dot", "general", "concat")


# --------------------------------------------------------------------------
# Hyperparameters


@dataclasses.dataclass(frozen=True)
class RNNConfig(ModelConfig):
    """What every recurrent family has; defaults are Bahdanau et al. section 4.2 and appendix
    A.2.3. (The capabilities of models/interface.py are its defaults: token sources, no limit on
    length, no attention.)"""

    # target vocabulary
    vocab_size: int
    # None: same as vocab_size
    source_vocab_size: int | None = None
    # "gru" or "lstm"
    cell: str = "gru"
    embed_dim: int = 620
    # per direction
    hidden_dim: int = 1000
    num_encoder_layers: int = 1
    num_decoder_layers: int = 1
    dropout_rate: float = 0.0
    # how dropout masks are drawn: "packed" or "bernoulli" (models/layers.py, `DROPOUT_MASKS`)
    dropout_masks: str = "packed"
    bos_id: int = 1
    pad_id: int = 0

    def __post_init__(self):
        if self.cell not in CELLS:
            raise ConfigError(f"model.cell must be one of {', '.join(CELLS)}, got {self.cell!r}")
        for name in ("embed_dim", "hidden_dim", "num_encoder_layers", "num_decoder_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        check_dropout(self, "dropout_rate")


@dataclasses.dataclass(frozen=True)
class RNNEncDecConfig(RNNConfig):
    # l, the maxout units of the deep output (Bahdanau appendix A.2.2; 500 in A.2.3)
    maxout_dim: int = 500


@dataclasses.dataclass(frozen=True)
class RNNSearchConfig(RNNEncDecConfig):
    # the additive attention over the annotations
    roles = frozenset({AttentionRole.CROSS})
    # n', the alignment model's hidden size (appendix A.2.2; 1000 in A.2.3)
    attention_dim: int = 1000


@dataclasses.dataclass(frozen=True)
class LuongConfig(RNNConfig):
    """Luong et al. section 4.1: 4 LSTM layers of 1000 cells, 1000-dim embeddings, dropout 0.2."""

    cell: str = "lstm"
    embed_dim: int = 1000
    num_encoder_layers: int = 4
    num_decoder_layers: int = 4
    dropout_rate: float = 0.2
    # "dot", "general" or "concat" (section 3.1)
    score: str = "general"
    # concat's hidden size; 0: hidden_dim
    attention_dim: int = 0
    # section 3.3
    input_feeding: bool = True

    # global attention over the encoder's states
    roles = frozenset({AttentionRole.CROSS})

    def __post_init__(self):
        super().__post_init__()
        if self.score not in LUONG_SCORES:
            raise ConfigError(f"model.score must be one of {', '.join(LUONG_SCORES)}, got {self.score!r}")
        if self.num_encoder_layers != self.num_decoder_layers:
            raise ConfigError(
                "the Luong decoder starts from the encoder's final states, so model.num_encoder_layers "
                f"({self.num_encoder_layers}) must equal model.num_decoder_layers ({self.num_decoder_layers})"
            )


# --------------------------------------------------------------------------
# Cells


class LSTMState(NamedTuple):
    # h [B, H]
    hidden: Array
    # c [B, H]
    cell: Array


class GRUCell(nnx.Module):
    """Gated recurrent unit, Bahdanau et al. appendix A.1.1 (Cho et al. 2014 eqs. 5-8):

        z = sigmoid(W_z x + U_z s),  r = sigmoid(W_r x + U_r s)
        s~ = tanh(W x + U [r * s])        (the reset gate acts before U)
        s' = (1 - z) * s + z * s~

    The input terms `W_* x` come in already projected (`project`), so that a
    caller can compute them for a whole sequence outside the scan and add
    further inputs (the context `C_* c_i`) as its own projections.
    """

    gates = 3

    def __init__(self, input_dim: int, hidden_dim: int, *, rngs: nnx.Rngs):
        self.input_proj = Linear(input_dim, 3 * hidden_dim, rngs=rngs)  # [W_z; W_r; W], biases
        orthogonal = nnx.initializers.orthogonal()
        self.gate_proj = Linear(hidden_dim, 2 * hidden_dim, use_bias=False, kernel_init=orthogonal, rngs=rngs)
        self.candidate_proj = Linear(hidden_dim, hidden_dim, use_bias=False, kernel_init=orthogonal, rngs=rngs)

    def project(self, x: Array) -> Array:
        """`[..., input_dim] -> [..., 3H]`."""
        return self.input_proj(x)

    def __call__(self, projected: Array, state: Array) -> Array:
        """`projected [B, 3H]`, `state s [B, H]` -> `s' [B, H]`."""
        x_zr, x_candidate = jnp.split(projected, [2 * state.shape[-1]], axis=-1)
        update, reset = jnp.split(jax.nn.sigmoid(x_zr + self.gate_proj(state)), 2, axis=-1)
        candidate = jnp.tanh(x_candidate + self.candidate_proj(reset * state))
        return (1.0 - update) * state + update * candidate

    @staticmethod
    def hidden(state: Array) -> Array:
        return state

    @staticmethod
    def start(hidden: Array) -> Array:
        return hidden


class LSTMCell(nnx.Module):
    """Long short-term memory (Zaremba et al. 2014 eq., as Luong et al. use it):

        [i; f; o; g] = [sigmoid; sigmoid; sigmoid; tanh](W x + U h + b)
        c' = f * c + i * g,   h' = o * tanh(c')

    The forget-gate bias starts at 1 (Jozefowicz et al. 2015). Inputs come in
    projected, as for `GRUCell`.
    """

    gates = 4

    def __init__(self, input_dim: int, hidden_dim: int, *, rngs: nnx.Rngs):
        self.input_proj = Linear(input_dim, 4 * hidden_dim, rngs=rngs)
        self.input_proj.bias[...] = jnp.zeros(4 * hidden_dim).at[hidden_dim : 2 * hidden_dim].set(1.0)
        orthogonal = nnx.initializers.orthogonal()
        self.hidden_proj = Linear(hidden_dim, 4 * hidden_dim, use_bias=False, kernel_init=orthogonal, rngs=rngs)

    def project(self, x: Array) -> Array:
        """`[..., input_dim] -> [..., 4H]`."""
        return self.input_proj(x)

    def __call__(self, projected: Array, state: LSTMState) -> LSTMState:
        """`projected [B, 4H]`, `state (h, c)` -> `(h', c')`."""
        i, f, o, g = jnp.split(projected + self.hidden_proj(state.hidden), 4, axis=-1)
        cell = jax.nn.sigmoid(f) * state.cell + jax.nn.sigmoid(i) * jnp.tanh(g)
        return LSTMState(jax.nn.sigmoid(o) * jnp.tanh(cell), cell)

    @staticmethod
    def hidden(state: LSTMState) -> Array:
        return state.hidden

    @staticmethod
    def start(hidden: Array) -> LSTMState:
        """A state with hidden `h` and an empty memory cell."""
        return LSTMState(hidden, jnp.zeros_like(hidden))


def cell_stack(kind: str, input_dim: int, hidden_dim: int, layers: int, rngs: nnx.Rngs) -> nnx.List:
    """`layers` cells of `kind`, the first reading `input_dim` features, the others the layer below."""
    cell_class = GRUCell if kind == "gru" else LSTMCell
    return nnx.List(
        cell_class(input_dim if layer == 0 else hidden_dim, hidden_dim, rngs=rngs) for layer in range(layers)
    )


def time_major(tree: Any) -> Any:
    """Swaps the batch and time axes of every leaf: `[B, T, ...] <-> [T, B, ...]`."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), tree)


def run_cell(cell: GRUCell | LSTMCell, projected: Array, mask: Array, *, reverse: bool = False) -> tuple[Array, Any]:
    """One direction of one layer over a whole right-padded sequence.

    Padding leaves the state as it was: the forward final state is the one at
    the last real token, and the backward pass starts fresh at it, so the
    backward output at `j` depends only on the tokens at `j` and after.

    Args:
      projected: `[B, S, G*H]`, the cell's projected inputs.
      mask: `[B, S]` bool, True at real tokens.
    Returns:
      `(outputs [B, S, H]` (zero at padding), final state).
    """
    batch, hidden_dim = projected.shape[0], projected.shape[-1] // cell.gates
    initial = cell.start(jnp.zeros((batch, hidden_dim), projected.dtype))

    def step(state, inputs):
        x, real = inputs
        new = jax.tree.map(lambda n, o: jnp.where(real[:, None], n, o), cell(x, state), state)
        return new, jnp.where(real[:, None], cell.hidden(new), 0.0)

    final, outputs = jax.lax.scan(step, initial, time_major((projected, mask)), reverse=reverse)
    return time_major(outputs), final


class Encoder(nnx.Module):
    """Stacked RNN over the source, forward only or in both directions (dropout between layers).

    Each direction is its own stack, each layer reading the one below of the
    same direction, so that the backward annotation at `j` depends only on the
    tokens at `j` and after, at any depth (interleaving the directions between
    layers would let it see the whole source).
    """

    def __init__(self, config: RNNConfig, *, bidirectional: bool, rngs: nnx.Rngs):
        def stack():
            return cell_stack(config.cell, config.embed_dim, config.hidden_dim, config.num_encoder_layers, rngs)

        self.forward_cells = stack()
        self.backward_cells = nnx.data(stack() if bidirectional else None)
        self.dropout = Dropout(config.dropout_rate, masks=config.dropout_masks, rngs=rngs)

    def _run_stack(self, cells, x: Array, mask: Array, reverse: bool, deterministic: bool) -> tuple[Array, list]:
        finals = []
        for layer, cell in enumerate(cells):
            if layer > 0:
                x = self.dropout(x, deterministic=deterministic)
            x, final = run_cell(cell, cell.project(x), mask, reverse=reverse)
            finals.append(final)
        return x, finals

    def __call__(self, x: Array, mask: Array, *, deterministic: bool) -> tuple[Array, list[Any]]:
        """`x [B, S, E]`, `mask [B, S]` -> `(top outputs [B, S, H or 2H]`, the forward final state per layer)`.

        Bidirectional outputs are the annotations `h_j = [forward h_j; backward h_j]` (Bahdanau section 3.2).
        """
        outputs, finals = self._run_stack(self.forward_cells, x, mask, False, deterministic)
        if self.backward_cells is not None:
            backward, _ = self._run_stack(self.backward_cells, x, mask, True, deterministic)
            outputs = jnp.concatenate([outputs, backward], axis=-1)
        return outputs, finals


# --------------------------------------------------------------------------
# The common encoder-decoder


class RNNMemory(NamedTuple):
    """What the encoder hands the decoder (leaves have a leading batch axis; None where unused).

    annotations: `[B, S, Dh]`, the values attended over.
    keys: `[B, S, A]`, their key projection, computed once per source.
    mask: `[B, S]` bool, True at real source tokens.
    initial: what the decoder's first state is made from.
    """

    annotations: Array | None
    keys: Array | None
    mask: Array
    initial: Any


class RNNDecodeState(NamedTuple):
    # each decoder layer's cell state
    layers: tuple
    # Luong's previous attentional state (input feeding); else None
    feed: Array | None


class RNNEncoderDecoder(nnx.Module):
    """The parts, teacher-forced pass and `decode_step` every recurrent family shares.

    Built here: the source and target embeddings `E` (separate tables, as in
    the papers), the decoder's cell stack and the dropout. A family adds its
    encoder and, if it attends, its `cross_attention`, and implements
    `encode`, `init_decode_state`, `_step` and `_readout`.
    """

    def __init__(self, config: RNNConfig, *, first_decoder_input: int, rngs: nnx.Rngs):
        """`first_decoder_input`: the features the first decoder cell reads (its other inputs,
        such as a context, are added to its projected input by the family)."""
        self.config = config
        init = nnx.initializers.normal(stddev=0.1)
        source_vocab = config.source_vocab_size or config.vocab_size
        self.source_embed = nnx.Embed(
            source_vocab, config.embed_dim, embedding_init=init, embedding_metadata=logical("vocab", "embed"), rngs=rngs
        )
        self.target_embed = nnx.Embed(
            config.vocab_size,
            config.embed_dim,
            embedding_init=init,
            embedding_metadata=logical("vocab", "embed"),
            rngs=rngs,
        )
        self.decoder_cells = cell_stack(
            config.cell, first_decoder_input, config.hidden_dim, config.num_decoder_layers, rngs
        )
        self.dropout = Dropout(config.dropout_rate, masks=config.dropout_masks, rngs=rngs)
        # set by the families that attend
        self.cross_attention = nnx.data(None)

    def _step(self, memory: RNNMemory, projected: Array, state: RNNDecodeState, masks: tuple) -> tuple:
        """One decoder step: `projected [B, G*H]` (the first cell's projected embedding of the
        previous token) -> `(state, readout features, attention weights [B, S] or None)`."""
        raise NotImplementedError

    def _readout(self, features: Any, embedded: Array, deterministic: bool) -> Array:
        """`features`, `embedded [..., E]` (the previous tokens) -> float32 logits `[..., V]`."""
        raise NotImplementedError

    def encode(self, inputs: Array, *, deterministic: bool = True) -> RNNMemory:
        raise NotImplementedError

    def init_decode_state(self, memory: RNNMemory, batch_size: int, max_len: int) -> RNNDecodeState:
        raise NotImplementedError

    def _embed_source(self, inputs: Array, deterministic: bool) -> tuple[Array, Array]:
        """`inputs [B, S]` -> `(dropout(E x) [B, S, E], mask [B, S])`."""
        return self.dropout(self.source_embed(inputs), deterministic=deterministic), inputs != self.config.pad_id

    def _layer_masks(self, batch: int, length: int, deterministic: bool) -> tuple[Array, ...]:
        """Dropout masks `[B, T, H]` for the inputs of decoder layers 2.. (scaled; empty when deterministic)."""
        if deterministic or self.config.dropout_rate == 0.0:
            return ()
        ones = jnp.ones((batch, length, self.config.hidden_dim))
        return tuple(self.dropout(ones, deterministic=False) for _ in self.decoder_cells[1:])

    def _stack_step(self, first: Array, layers: tuple, masks: tuple) -> tuple:
        """The decoder stack one step on: `first [B, G*H]`, the first layer's projected input."""
        new_layers = []
        for index, (cell, state) in enumerate(zip(self.decoder_cells, layers)):
            if index > 0:
                below = self.decoder_cells[index - 1].hidden(new_layers[-1])
                first = cell.project(below * masks[index - 1] if masks else below)
            new_layers.append(cell(first, state))
        return tuple(new_layers)

    def _top_hidden(self, layers: tuple) -> Array:
        return self.decoder_cells[-1].hidden(layers[-1])

    def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
        """Teacher-forced logits `[B, T, V]` for `batch['targets']` given `batch['inputs']`."""
        if "inputs_segment_ids" in batch:
            raise ConfigError("the recurrent models do not read packed rows; set data.batching='bucket'")
        targets = batch["targets"]
        memory = self.encode(batch["inputs"], deterministic=deterministic)
        embedded = self.dropout(
            self.target_embed(shift_right(targets, self.config.bos_id)), deterministic=deterministic
        )  # [B, T, E]
        projected = self.decoder_cells[0].project(embedded)  # [B, T, G*H], outside the scan
        masks = self._layer_masks(*targets.shape, deterministic)

        def step(state, inputs):
            x, layer_masks = inputs  # [B, G*H], ([B, H] per layer above the first)
            state, features, weights = self._step(memory, x, state, layer_masks)
            return state, (features, weights)

        initial = self.init_decode_state(memory, targets.shape[0], targets.shape[1])
        _, (features, weights) = jax.lax.scan(step, initial, time_major((projected, masks)))
        features, weights = time_major((features, weights))
        if self.cross_attention is not None:
            self.cross_attention.record(weights)  # [B, T, S]
        return self._readout(features, embedded, deterministic)

    def decode_step(self, memory: RNNMemory, token: Array, state: RNNDecodeState) -> tuple[Array, RNNDecodeState]:
        """Next-token logits: `token [B]` (the previous output, bos first) -> `(logits [B, V], state)`."""
        embedded = self.target_embed(token)  # [B, E]
        state, features, _ = self._step(memory, self.decoder_cells[0].project(embedded), state, ())
        return self._readout(features, embedded, True), state


# --------------------------------------------------------------------------
# RNNencdec and RNNsearch: one decoder, fed a fixed summary or an attended context


class ReadoutFeatures(NamedTuple):
    # s_i of the top decoder layer
    hidden: Array
    # c_i
    context: Array


class ContextDecoderModel(RNNEncoderDecoder):
    """The decoder of Cho et al. (2014) and Bahdanau et al. (2015), appendix A.2.2.

    Each step reads a context `c_i` (the fixed summary, or the attention's):
    `s_i = f(s_{i-1}, y_{i-1}, c_i)` with the context in every gate
    (`W E y_{i-1} + U s_{i-1} + C c_i`), then the deep output with maxout:
    `t~_i = U_o s_i + V_o E y_{i-1} + C_o c_i`, `t_i = max(t~_{i,2j-1}, t~_{i,2j})`,
    `p(y_i) = softmax(W_o t_i)`. (Eq. 4 conditions the output on `s_i`; the
    appendix writes `s_{i-1}`, and so does the authors' code: GroundHog's
    experiments/nmt/encdec.py, `Decoder.build_decoder`, reads out from the decoder
    states shifted one step, the initial state first, i.e. from `s_{i-1}`. We
    follow eq. 4.)
    """

    def __init__(self, config: RNNEncDecConfig, *, context_dim: int, initial_dim: int, rngs: nnx.Rngs):
        super().__init__(config, first_decoder_input=config.embed_dim, rngs=rngs)
        hidden, maxout = config.hidden_dim, config.maxout_dim
        gates = self.decoder_cells[0].gates * hidden
        # C, C_z, C_r
        self.context_proj = Linear(context_dim, gates, use_bias=False, rngs=rngs)
        # W_s
        self.initial_proj = Linear(initial_dim, config.num_decoder_layers * hidden, rngs=rngs)
        # U_o (and the bias)
        self.readout_hidden = Linear(hidden, 2 * maxout, rngs=rngs)
        # V_o
        self.readout_embedding = Linear(config.embed_dim, 2 * maxout, use_bias=False, rngs=rngs)
        # C_o
        self.readout_context = Linear(context_dim, 2 * maxout, use_bias=False, rngs=rngs)
        # W_o
        self.output = Linear(maxout, config.vocab_size, axes=("embed", "vocab"), rngs=rngs)

    def _context(self, memory: RNNMemory, previous_hidden: Array) -> tuple[Array, Array | None]:
        """`c_i` `[B, Dc]` and the attention weights `[B, S]` (None without attention)."""
        raise NotImplementedError

    def init_decode_state(self, memory: RNNMemory, batch_size: int, max_len: int) -> RNNDecodeState:
        """`s_0 = tanh(W_s memory.initial)`, one slice of `W_s` per decoder layer."""
        starts = jnp.split(jnp.tanh(self.initial_proj(memory.initial)), self.config.num_decoder_layers, axis=-1)
        return RNNDecodeState(tuple(cell.start(h) for cell, h in zip(self.decoder_cells, starts)), None)

    def _step(self, memory, projected, state, masks):
        """Step i of the decoder (Bahdanau et al. appendix A.2.2; RNNencdec with `c_i` fixed to the summary):

        1. the context `c_i` from `s_{i-1}`: the fixed summary `c`, or attention `e_ij =
           v^T tanh(W s_{i-1} + U h_j)` (appendix A.1.2), `alpha_ij = softmax_j(e_ij)` (eq. 6), `c_i = sum_j
           alpha_ij h_j` (eq. 5);
        2. `s_i = f(s_{i-1}, y_{i-1}, c_i)`: every gate of the first cell reads `W E y_{i-1}`
           (already in `projected`) `+ C c_i`; layers above read the layer below;
        3. the readout features `(s_i, c_i)` for the deep output (`_readout`, appendix A.2.2's `t~_i`).
        """
        # 1. c_i from s_{i-1}
        context, weights = self._context(memory, self._top_hidden(state.layers))
        # 2. s_i
        layers = self._stack_step(projected + self.context_proj(context), state.layers, masks)
        # 3.
        return RNNDecodeState(layers, None), ReadoutFeatures(self._top_hidden(layers), context), weights

    def _readout(self, features: ReadoutFeatures, embedded: Array, deterministic: bool) -> Array:
        # t~ [..., 2l]
        pre_maxout = (
            self.readout_hidden(features.hidden)
            + self.readout_embedding(embedded)
            + self.readout_context(features.context)
        )
        # t [..., l]
        maxout = pre_maxout.reshape(*pre_maxout.shape[:-1], -1, 2).max(axis=-1)
        return self.output(self.dropout(maxout, deterministic=deterministic)).astype(jnp.float32)


class RNNEncDec(ContextDecoderModel):
    """Cho et al. (2014) section 2.2 and appendix A: the summary `c = tanh(V h_N)` of a forward
    encoder is the context at every decoder step, and `s_0 = tanh(V' c)`. No attention: the
    fixed-length bottleneck."""

    def __init__(self, config: RNNEncDecConfig, *, rngs: nnx.Rngs):
        super().__init__(config, context_dim=config.hidden_dim, initial_dim=config.hidden_dim, rngs=rngs)
        self.encoder = Encoder(config, bidirectional=False, rngs=rngs)
        # V
        self.summary_proj = Linear(config.hidden_dim, config.hidden_dim, rngs=rngs)

    def encode(self, inputs: Array, *, deterministic: bool = True) -> RNNMemory:
        """`inputs [B, S]` -> memory whose `initial` is the summary `c [B, H]`."""
        x, mask = self._embed_source(inputs, deterministic)
        _, forward_finals = self.encoder(x, mask, deterministic=deterministic)
        # h_N of the top layer
        last_hidden = self.encoder.forward_cells[-1].hidden(forward_finals[-1])
        return RNNMemory(None, None, mask, jnp.tanh(self.summary_proj(last_hidden)))

    def _context(self, memory, previous_hidden):
        return memory.initial, None


class RNNSearch(ContextDecoderModel):
    """Bahdanau et al. (2015): bidirectional encoder and additive attention.

    Annotations `h_j = [forward h_j; backward h_j]` (section 3.2, eq. 7); alignment
    `e_ij = v^T tanh(W s_{i-1} + U h_j)` (appendix A.1.2), `alpha = softmax(e)` (eq. 6),
    `c_i = sum_j alpha_ij h_j` (eq. 5); `s_0 = tanh(W_s backward h_1)` (appendix A.2.2).
    """

    def __init__(self, config: RNNSearchConfig, *, rngs: nnx.Rngs):
        annotation_dim = 2 * config.hidden_dim
        super().__init__(config, context_dim=annotation_dim, initial_dim=config.hidden_dim, rngs=rngs)
        self.encoder = Encoder(config, bidirectional=True, rngs=rngs)
        self.cross_attention = Attention(
            config.hidden_dim, annotation_dim, score="additive", attention_dim=config.attention_dim, rngs=rngs
        )

    def encode(self, inputs: Array, *, deterministic: bool = True) -> RNNMemory:
        """`inputs [B, S]` -> annotations `[B, S, 2H]`, `U h_j` (once), and `backward h_1` for `s_0`."""
        x, mask = self._embed_source(inputs, deterministic)
        annotations, _ = self.encoder(x, mask, deterministic=deterministic)
        # backward h_1 [B, H]
        backward_first = annotations[:, 0, self.config.hidden_dim :]
        return RNNMemory(annotations, self.cross_attention.project_keys(annotations), mask, backward_first)

    def _context(self, memory, previous_hidden):
        return self.cross_attention(previous_hidden, memory.keys, memory.annotations, memory.mask)


# --------------------------------------------------------------------------
# Luong et al. (2015)


class Luong(RNNEncoderDecoder):
    """Global attention (Luong et al. 2015, section 3.1) over a stacked LSTM (or GRU).

    The decoder starts from the encoder's final states. Each step: `h_t` from
    the stack (whose first layer reads `[E y_{t-1}; h~_{t-1}]` with input
    feeding, section 3.3), scores `score(h_t, h_s)` (section 3.1: dot, general,
    concat), `a_t = softmax` (eq. 7), `c_t = sum_s a_ts h_s`, the attentional
    state `h~_t = tanh(W_c [c_t; h_t])` (eq. 5) and `p(y_t) = softmax(W_s h~_t)` (eq. 6).
    """

    def __init__(self, config: LuongConfig, *, rngs: nnx.Rngs):
        super().__init__(config, first_decoder_input=config.embed_dim, rngs=rngs)
        hidden = config.hidden_dim
        self.encoder = Encoder(config, bidirectional=False, rngs=rngs)
        gates = self.decoder_cells[0].gates * hidden
        # the h~_{t-1} half of the first layer's input weights
        self.feed_proj = nnx.data(Linear(hidden, gates, use_bias=False, rngs=rngs) if config.input_feeding else None)
        self.cross_attention = Attention(
            hidden, hidden, score=config.score, attention_dim=config.attention_dim or None, rngs=rngs
        )
        # W_c
        self.attentional = Linear(2 * hidden, hidden, use_bias=False, rngs=rngs)
        # W_s
        self.output = Linear(hidden, config.vocab_size, axes=("embed", "vocab"), rngs=rngs)

    def encode(self, inputs: Array, *, deterministic: bool = True) -> RNNMemory:
        """`inputs [B, S]` -> the top layer's states `h_s [B, S, H]`, their key projection, and the final states."""
        x, mask = self._embed_source(inputs, deterministic)
        states, finals = self.encoder(x, mask, deterministic=deterministic)
        return RNNMemory(states, self.cross_attention.project_keys(states), mask, tuple(finals))

    def init_decode_state(self, memory: RNNMemory, batch_size: int, max_len: int) -> RNNDecodeState:
        feed = jnp.zeros((batch_size, self.config.hidden_dim)) if self.config.input_feeding else None
        return RNNDecodeState(memory.initial, feed)

    def _step(self, memory, projected, state, masks):
        """Step t of the decoder (Luong et al. sections 3.1 and 3.3):

        1. input feeding: the first layer reads `[E y_{t-1}; h~_{t-1}]` (section 3.3);
        2. `h_t` from the stacked cells;
        3. scores `score(h_t, h_s)` (section 3.1), `a_t = softmax` (eq. 7), `c_t = sum_s a_ts h_s`;
        4. the attentional state `h~_t = tanh(W_c [c_t; h_t])` (eq. 5), read out by `_readout` (eq. 6).
        """
        if state.feed is not None:
            # 1.
            projected = projected + self.feed_proj(state.feed)
        layers = self._stack_step(projected, state.layers, masks)
        # 2. h_t
        hidden = self._top_hidden(layers)
        # 3.
        context, weights = self.cross_attention(hidden, memory.keys, memory.annotations, memory.mask)
        # 4. h~_t
        attentional = jnp.tanh(self.attentional(jnp.concatenate([context, hidden], axis=-1)))
        return RNNDecodeState(layers, attentional if state.feed is not None else None), attentional, weights

    def _readout(self, features: Array, embedded: Array, deterministic: bool) -> Array:
        return self.output(self.dropout(features, deterministic=deterministic)).astype(jnp.float32)
