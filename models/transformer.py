"""The Transformer of Vaswani et al. (2017), "Attention Is All You Need", arXiv:1706.03762v7.

Encoder: N layers of [self-attention, feed-forward]; decoder: N layers of
[masked self-attention, encoder-decoder attention, feed-forward] (section 3.1).
Each sub-layer is wrapped as `LayerNorm(x + Dropout(Sublayer(x)))` (sections
3.1 and 5.4), or pre-LN `x + Dropout(Sublayer(LayerNorm(x)))` as an option.

Batches are dicts of `[B, S]` / `[B, T]` int arrays: `inputs`, `targets`, and
for packed rows `inputs_segment_ids`, `inputs_positions`,
`targets_segment_ids`, `targets_positions` (segment ids 1, 2, ...; 0 = padding).
Axis names as in `models/attention.py`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention
from models.attention import AttentionRole, KVCache, MultiHeadAttention
from models.interface import ModelConfig
from models.layers import (
    Dropout,
    Embed,
    FeedForward,
    LearnedPositions,
    Linear,
    Unreordered,
    check_dropout,
    layer_norm,
    shift_right,
    sinusoidal_encoding,
)
from utils.errors import ConfigError

Array = jax.Array

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ModelConfig):
    """Hyperparameters; the defaults are the paper's base model (table 3)."""

    # `Transformer.decode`, the teacher-forced decoder stack (models/interface.py)
    has_decode = True
    # a saved config without `use_bias` comes from a time its default was True (until 2026-11-28)
    fields_before = {**ModelConfig.fields_before, "use_bias": True}

    # target vocabulary (and source, when shared)
    vocab_size: int
    # None: same as vocab_size
    source_vocab_size: int | None = None
    d_model: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048
    # residual dropout, P_drop of section 5.4
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    relu_dropout_rate: float = 0.0
    # how dropout masks are drawn: "packed" or "bernoulli" (models/layers.py, `DROPOUT_MASKS`)
    dropout_masks: str = "packed"
    pre_layer_norm: bool = False
    # one embedding for source and target (section 3.4)
    share_embeddings: bool = True
    # the target embedding is also the pre-softmax projection
    tie_output: bool = True
    # positions: "sinusoidal" (section 3.5) or "learned"
    positional: str = "sinusoidal"
    # for learned positions
    max_length: int = 512
    score: str = "scaled_dot"
    # biases on the attention's query, value and output projections: none in the paper (section
    # 3.2.2's W^Q_i, W^K_i, W^V_i and W^O are plain matrices) nor in the authors' tensor2tensor
    use_bias: bool = False
    # compute dtype; parameters and softmax stay float32
    dtype: str = "float32"
    bos_id: int = 1
    pad_id: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.score not in attention.SCORES:
            raise ConfigError(f"model.score must be one of {', '.join(attention.SCORES)}, got {self.score!r}")
        if self.positional not in ("sinusoidal", "learned"):
            raise ConfigError(f"model.positional must be 'sinusoidal' or 'learned', got {self.positional!r}")
        for name in ("d_model", "num_heads", "d_ff", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        for name in ("num_encoder_layers", "num_decoder_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must not be negative, got {getattr(self, name)}")
        check_dropout(self, "dropout_rate", "attention_dropout_rate", "relu_dropout_rate")
        if self.d_model % self.num_heads:
            raise ConfigError(f"model.d_model {self.d_model} is not divisible by model.num_heads {self.num_heads}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"model.d_model must be even for sinusoidal positions, got {self.d_model}")
        if self.share_embeddings and self.source_vocab_size not in (None, self.vocab_size):
            raise ConfigError(
                f"model.share_embeddings needs one vocabulary, got source {self.source_vocab_size} "
                f"and target {self.vocab_size}"
            )

    @property
    def length_limit(self) -> int | None:
        """The longest sequence the model can read or write: learned positions end at `max_length`."""
        return self.max_length if self.positional == "learned" else None

    @property
    def needs_shared_vocabulary(self) -> bool:
        """One embedding table for source and target needs one vocabulary."""
        return self.share_embeddings

    @property
    def roles(self) -> frozenset[AttentionRole]:
        """Encoder self-attention, and the decoder's masked self- and encoder-decoder attention (a stack
        of no layers has none)."""
        encoder = {AttentionRole.SOURCE_SELF} if self.num_encoder_layers else set()
        decoder = {AttentionRole.TARGET_SELF, AttentionRole.CROSS} if self.num_decoder_layers else set()
        return frozenset(encoder | decoder)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return DTYPES[self.dtype]


class Memory(NamedTuple):
    """What the encoder hands the decoder: `encoded [B, S, D]`, `mask [B, S]` (True = real token)."""

    encoded: Array
    mask: Array


class DecodeState(NamedTuple):
    """Per decoder layer: the self-attention cache and the source's keys/values (computed once, one
    row per source, heads-major `[G, N, S, H]`); the tied output table `[D, V]` (made once; None for
    an output layer of its own). `Unreordered`: beam search leaves the last two in place."""

    caches: tuple[KVCache, ...]
    # each decoder layer's (keys, values) of the source: tuple[tuple[Array, Array], ...]
    cross_keys_values: Unreordered
    # Embed.output_table() or None
    output_table: Unreordered


class Residual(nnx.Module):
    """Residual connection and LayerNorm around one sub-layer (section 3.1; pre-LN as an option).

    Call `inputs(x)` for the sub-layer's input and `outputs(x, y)` with its output `y`.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.pre_norm = config.pre_layer_norm
        self.norm = layer_norm(config.d_model, dtype=config.compute_dtype, rngs=rngs)
        self.dropout = Dropout(config.dropout_rate, masks=config.dropout_masks, rngs=rngs)

    def inputs(self, x: Array) -> Array:
        return self.norm(x) if self.pre_norm else x

    def outputs(self, x: Array, y: Array, *, deterministic: bool) -> Array:
        x = x + self.dropout(y, deterministic=deterministic)
        return x if self.pre_norm else self.norm(x)


def _attention(config: TransformerConfig, role: AttentionRole, rngs: nnx.Rngs) -> MultiHeadAttention:
    return MultiHeadAttention(
        config.num_heads,
        config.d_model,
        score=config.score,
        dropout_rate=config.attention_dropout_rate,
        dropout_masks=config.dropout_masks,
        use_bias=config.use_bias,
        role=role,
        dtype=config.compute_dtype,
        rngs=rngs,
    )


def _feed_forward(config: TransformerConfig, rngs: nnx.Rngs) -> FeedForward:
    return FeedForward(
        config.d_model,
        config.d_ff,
        dropout_rate=config.relu_dropout_rate,
        dropout_masks=config.dropout_masks,
        dtype=config.compute_dtype,
        rngs=rngs,
    )


class EncoderLayer(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.self_attention = _attention(config, AttentionRole.SOURCE_SELF, rngs)
        self.attention_residual = Residual(config, rngs=rngs)
        self.feed_forward = _feed_forward(config, rngs)
        self.feed_forward_residual = Residual(config, rngs=rngs)

    def __call__(self, x: Array, mask: Array, *, deterministic: bool) -> Array:
        """`[B, S, D]`, mask `[B, 1, S, S]` -> `[B, S, D]`."""
        y = self.self_attention(self.attention_residual.inputs(x), mask=mask, deterministic=deterministic)
        x = self.attention_residual.outputs(x, y, deterministic=deterministic)
        y = self.feed_forward(self.feed_forward_residual.inputs(x), deterministic=deterministic)
        return self.feed_forward_residual.outputs(x, y, deterministic=deterministic)


class DecoderLayer(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.self_attention = _attention(config, AttentionRole.TARGET_SELF, rngs)
        self.self_attention_residual = Residual(config, rngs=rngs)
        self.cross_attention = _attention(config, AttentionRole.CROSS, rngs)
        self.cross_attention_residual = Residual(config, rngs=rngs)
        self.feed_forward = _feed_forward(config, rngs)
        self.feed_forward_residual = Residual(config, rngs=rngs)

    def __call__(self, x: Array, memory: Array, self_mask: Array, cross_mask: Array, *, deterministic: bool) -> Array:
        """Teacher-forced: `x [B, T, D]`, `memory [B, S, D]`, masks `[B, 1, T, T]` / `[B, 1, T, S]` -> `[B, T, D]`."""
        y = self.self_attention(self.self_attention_residual.inputs(x), mask=self_mask, deterministic=deterministic)
        x = self.self_attention_residual.outputs(x, y, deterministic=deterministic)
        y = self.cross_attention(
            self.cross_attention_residual.inputs(x), memory, mask=cross_mask, deterministic=deterministic
        )
        x = self.cross_attention_residual.outputs(x, y, deterministic=deterministic)
        return self._through_feed_forward(x, deterministic)

    def decode(
        self, x: Array, cache: KVCache, cross_key: Array, cross_value: Array, cross_mask: Array
    ) -> tuple[Array, KVCache]:
        """One step of G sources' K hypotheses each: `x [G*K, 1, D]`, the sources' keys and values
        `[G, N, S, H]`, `cross_mask [G, 1, 1, S]` -> `([G*K, 1, D], cache one position longer)`."""
        y, cache = self.self_attention.decode(self.self_attention_residual.inputs(x), cache)
        x = self.self_attention_residual.outputs(x, y, deterministic=True)
        y = self.cross_attention.attend_per_group(
            self.cross_attention_residual.inputs(x), cross_key, cross_value, cross_mask
        )
        x = self.cross_attention_residual.outputs(x, y, deterministic=True)
        return self._through_feed_forward(x, True), cache

    def _through_feed_forward(self, x: Array, deterministic: bool) -> Array:
        y = self.feed_forward(self.feed_forward_residual.inputs(x), deterministic=deterministic)
        return self.feed_forward_residual.outputs(x, y, deterministic=deterministic)


class Transformer(nnx.Module):
    """Encoder-decoder Transformer behind the common model interface (models/interface.py `EncoderDecoder`)."""

    # The decode steps take one memory row per source, however many hypotheses of it they extend:
    # the hypotheses of a source read its keys and values once, together (`attend_per_group`).
    memory_per_source = True

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = config.compute_dtype
        self.target_embed = Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        if config.share_embeddings:
            self.source_embed = self.target_embed
        else:
            source_vocab = config.source_vocab_size or config.vocab_size
            self.source_embed = Embed(source_vocab, config.d_model, dtype=dtype, rngs=rngs)
        self.positions = nnx.data(
            LearnedPositions(config.max_length, config.d_model, dtype=dtype, rngs=rngs)
            if config.positional == "learned"
            else None
        )
        self.embed_dropout = Dropout(config.dropout_rate, masks=config.dropout_masks, rngs=rngs)
        self.encoder_layers = nnx.List([EncoderLayer(config, rngs=rngs) for _ in range(config.num_encoder_layers)])
        self.decoder_layers = nnx.List([DecoderLayer(config, rngs=rngs) for _ in range(config.num_decoder_layers)])
        # Pre-LN leaves the last residual sum unnormalised: one more LayerNorm per stack.
        final_norm = lambda: layer_norm(config.d_model, dtype=dtype, rngs=rngs) if config.pre_layer_norm else None
        self.encoder_norm = nnx.data(final_norm())
        self.decoder_norm = nnx.data(final_norm())
        self.output = nnx.data(
            None
            if config.tie_output
            else Linear(config.d_model, config.vocab_size, axes=("embed", "vocab"), dtype=dtype, rngs=rngs)
        )

    # -- pieces -------------------------------------------------------------

    def _embed(self, embed: Embed, tokens: Array, positions: Array, deterministic: bool) -> Array:
        """Token embedding + positional encoding, then dropout (section 5.4): `[B, T] -> [B, T, D]`."""
        if self.positions is None:
            position_codes = sinusoidal_encoding(positions, self.config.d_model)
        else:
            position_codes = self.positions(positions)
        x = (embed(tokens) + position_codes).astype(self.config.compute_dtype)
        return self.embed_dropout(x, deterministic=deterministic)

    def _logits(self, x: Array, table: Array | None = None) -> Array:
        """`[B, T, D] -> float32 [B, T, V]`; `table`: the tied output table, made once (`init_decode_state`)."""
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        logits = self.target_embed.attend(x, table) if self.output is None else self.output(x)
        return logits.astype(jnp.float32)

    # -- the model interface ---------------------------------------------------

    def encode(
        self,
        inputs: Array,
        *,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        deterministic: bool = True,
    ) -> Memory:
        """Encoder stack: `inputs [B, S]` -> `Memory(encoded [B, S, D], mask [B, S])`."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        if segment_ids is None:
            mask = attention.padding_mask(inputs, inputs, self.config.pad_id)  # [B, 1, S, S]
        else:
            mask = attention.segment_mask(segment_ids, segment_ids)
        x = self._embed(self.source_embed, inputs, positions, deterministic)
        for layer in self.encoder_layers:
            x = layer(x, mask, deterministic=deterministic)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return Memory(x, inputs != self.config.pad_id)

    def decode(
        self,
        targets: Array,
        memory: Memory,
        *,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        memory_segment_ids: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """Teacher-forced decoder: logits for `targets [B, T]` given the memory -> `[B, T, V]`."""
        decoder_inputs = shift_right(targets, self.config.bos_id, segment_ids)  # [B, T]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(targets.shape[1]), targets.shape)
        causal = attention.causal_mask(targets.shape[1])  # [1, 1, T, T]
        if segment_ids is None:
            self_mask = attention.combine_masks(causal, attention.padding_mask(targets, targets, self.config.pad_id))
            target_real = targets != self.config.pad_id
            cross_mask = target_real[:, None, :, None] & memory.mask[:, None, None, :]  # [B, 1, T, S]
        else:
            self_mask = attention.combine_masks(causal, attention.segment_mask(segment_ids, segment_ids))
            cross_mask = attention.segment_mask(segment_ids, memory_segment_ids)
        x = self._embed(self.target_embed, decoder_inputs, positions, deterministic)
        for layer in self.decoder_layers:
            x = layer(x, memory.encoded, self_mask, cross_mask, deterministic=deterministic)
        return self._logits(x)

    def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
        """Teacher-forced logits `[B, T, V]` for `batch['targets']` given `batch['inputs']`."""
        memory = self.encode(
            batch["inputs"],
            segment_ids=batch.get("inputs_segment_ids"),
            positions=batch.get("inputs_positions"),
            deterministic=deterministic,
        )
        return self.decode(
            batch["targets"],
            memory,
            segment_ids=batch.get("targets_segment_ids"),
            positions=batch.get("targets_positions"),
            memory_segment_ids=batch.get("inputs_segment_ids"),
            deterministic=deterministic,
        )

    def init_decode_state(self, memory: Memory, batch_size: int, max_len: int) -> DecodeState:
        """Empty self-attention caches and each layer's keys/values of the source, for `batch_size`
        rows: the hypotheses of `memory`'s sources, as many of each (`memory_per_source`); the tied
        output table `[D, V]` (None for an output layer of its own)."""
        sources = memory.encoded.shape[0]
        if batch_size % sources:
            raise ValueError(f"{batch_size} decoding rows are not a number of hypotheses for each of {sources} sources")
        hypotheses = batch_size // sources
        caches = tuple(
            layer.self_attention.init_cache(batch_size, max_len, self.config.compute_dtype, hypotheses=hypotheses)
            for layer in self.decoder_layers
        )
        cross = tuple(layer.cross_attention.project_source(memory.encoded) for layer in self.decoder_layers)
        table = self.target_embed.output_table() if self.output is None else None
        return DecodeState(caches, Unreordered(cross), Unreordered(table))

    def decode_step(self, memory: Memory, token: Array, state: DecodeState) -> tuple[Array, DecodeState]:
        """Next-token logits: `token [G*K]` (the previous output of K hypotheses of each of `memory`'s
        G sources, bos first) -> `(logits [G*K, V], state)`."""
        position = state.caches[0].index
        x = self._embed(self.target_embed, token[:, None], jnp.full(token.shape + (1,), position), True)  # [G*K, 1, D]
        cross_mask = memory.mask[:, None, None, :]  # [G, 1, 1, S]
        caches = []
        for layer, cache, (cross_key, cross_value) in zip(
            self.decoder_layers, state.caches, state.cross_keys_values.arrays
        ):
            x, cache = layer.decode(x, cache, cross_key, cross_value, cross_mask)
            caches.append(cache)
        logits = self._logits(x, state.output_table.arrays)[:, 0]
        return logits, DecodeState(tuple(caches), state.cross_keys_values, state.output_table)
