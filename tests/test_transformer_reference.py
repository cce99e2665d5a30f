"""The Transformer against a float64 NumPy forward pass written from Vaswani et al. (2017).

The reference copies the model's weights and recomputes, independently of
models/: eq. 1 (scaled dot-product attention), section 3.2.2 (multi-head),
eq. 2 (the feed-forward network), section 3.1 (LayerNorm(x + Sublayer(x)), or
pre-LN x + Sublayer(LayerNorm(x)) with a final LayerNorm per stack), section
3.4 (embeddings times sqrt(d_model), the shared embedding as the output
projection) and section 3.5 (sinusoidal positions). A model with one of those
pieces wired wrongly must fail it: `test_the_reference_catches_a_broken_model`
breaks the implementation three ways and checks that the comparison fails.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from helpers.references import np_layer_norm, np_masked_softmax
from models import transformer

VOCAB, D, HEADS, FF = 11, 8, 2, 12


def f64(variable):
    return np.asarray(variable[...], np.float64)


def build(pre_layer_norm: bool, layers: int = 1, use_bias: bool = False):
    return models.create_model(
        "transformer",
        rngs=nnx.Rngs(7),
        vocab_size=VOCAB,
        d_model=D,
        num_heads=HEADS,
        d_ff=FF,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
        dropout_rate=0.0,
        pre_layer_norm=pre_layer_norm,
        use_bias=use_bias,
    )


def batch():
    # the second source is padded
    inputs = np.array([[4, 5, 6, 7, 2], [8, 9, 2, 0, 0]])
    # the first target is padded
    targets = np.array([[5, 6, 2, 0], [7, 7, 8, 2]])
    return {"inputs": inputs, "targets": targets}


# ---------------------------------------------------------------- the reference


def layer_norm(x, norm):
    return np_layer_norm(x, f64(norm.scale), f64(norm.bias))


def multi_head(queries_from, keys_from, mask, attention):
    """Section 3.2.2: heads of softmax(Q K^T / sqrt(d_k)) V (eq. 1), concatenated, times W^O.
    `mask [B, Tq, Tk]`, True = may attend."""

    def project(x, dense):
        y = x @ f64(dense.kernel) + bias(dense)
        return y.reshape(*y.shape[:-1], HEADS, D // HEADS)  # [B, T, N, H]

    q = project(queries_from, attention.query)
    k, v = project(keys_from, attention.key), project(keys_from, attention.value)
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(D // HEADS)
    weights = np_masked_softmax(scores, mask[:, None])
    heads = np.einsum("bnqk,bknh->bqnh", weights, v).reshape(*queries_from.shape[:-1], D)
    return heads @ f64(attention.out.kernel) + bias(attention.out)


def bias(dense):
    """A projection's bias, 0 where it has none (the paper's attention projections, the key's always)."""
    return 0.0 if dense.bias is None else f64(dense.bias)


def feed_forward(x, ffn):
    """Eq. 2: max(0, x W1 + b1) W2 + b2."""
    return np.maximum(0.0, x @ f64(ffn.inner.kernel) + f64(ffn.inner.bias)) @ f64(ffn.outer.kernel) + f64(
        ffn.outer.bias
    )


def sublayer(x, residual, function, pre_layer_norm):
    """Section 3.1: LayerNorm(x + Sublayer(x)); pre-LN: x + Sublayer(LayerNorm(x))."""
    if pre_layer_norm:
        return x + function(layer_norm(x, residual.norm))
    return layer_norm(x + function(x), residual.norm)


def encoder_layer(x, mask, layer, pre_layer_norm):
    x = sublayer(x, layer.attention_residual, lambda y: multi_head(y, y, mask, layer.self_attention), pre_layer_norm)
    return sublayer(x, layer.feed_forward_residual, lambda y: feed_forward(y, layer.feed_forward), pre_layer_norm)


def decoder_layer(x, memory, self_mask, cross_mask, layer, pre_layer_norm):
    x = sublayer(
        x, layer.self_attention_residual, lambda y: multi_head(y, y, self_mask, layer.self_attention), pre_layer_norm
    )
    x = sublayer(
        x,
        layer.cross_attention_residual,
        lambda y: multi_head(y, memory, cross_mask, layer.cross_attention),
        pre_layer_norm,
    )
    return sublayer(x, layer.feed_forward_residual, lambda y: feed_forward(y, layer.feed_forward), pre_layer_norm)


def positions(length):
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    table = np.zeros((length, D))
    for pos in range(length):
        for i in range(D // 2):
            table[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / D))
            table[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / D))
    return table


def masks(inputs, targets):
    source_real, target_real = inputs != 0, targets != 0
    encoder = source_real[:, :, None] & source_real[:, None, :]  # [B, S, S]
    causal = np.tril(np.ones((targets.shape[1],) * 2, bool))
    decoder = causal[None] & target_real[:, :, None] & target_real[:, None, :]  # [B, T, T]
    cross = target_real[:, :, None] & source_real[:, None, :]  # [B, T, S]
    return encoder, decoder, cross


def forward(model, inputs, targets, pre_layer_norm):
    """The whole model: logits `[B, T, V]` for teacher-forced targets (decoder inputs = bos, y_1, ...)."""
    # shared by source, target and output (section 3.4)
    table = f64(model.target_embed.embedding.embedding)
    encoder_mask, decoder_mask, cross_mask = masks(inputs, targets)
    x = table[inputs] * math.sqrt(D) + positions(inputs.shape[1])
    for layer in model.encoder_layers:
        x = encoder_layer(x, encoder_mask, layer, pre_layer_norm)
    memory = layer_norm(x, model.encoder_norm) if pre_layer_norm else x
    # bos = 1
    decoder_inputs = np.concatenate([np.ones((len(targets), 1), int), targets[:, :-1]], axis=1)
    y = table[decoder_inputs] * math.sqrt(D) + positions(targets.shape[1])
    for layer in model.decoder_layers:
        y = decoder_layer(y, memory, decoder_mask, cross_mask, layer, pre_layer_norm)
    if pre_layer_norm:
        y = layer_norm(y, model.decoder_norm)
    return y @ table.T


# ---------------------------------------------------------------- the tests


def random_activations(shape, seed):
    return np.random.default_rng(seed).normal(size=shape)


@pytest.mark.parametrize("pre_layer_norm", [False, True], ids=["post-LN", "pre-LN"])
def test_one_encoder_layer_and_one_decoder_layer(pre_layer_norm):
    model = build(pre_layer_norm)
    b = batch()
    encoder_mask, decoder_mask, cross_mask = masks(b["inputs"], b["targets"])
    x = random_activations((2, 5, D), 0)
    layer = model.encoder_layers[0]
    got = layer(jnp.float32(x), jnp.asarray(encoder_mask[:, None]), deterministic=True)
    np.testing.assert_allclose(got, encoder_layer(x, encoder_mask, layer, pre_layer_norm), rtol=1e-4, atol=1e-5)

    y, memory = random_activations((2, 4, D), 1), random_activations((2, 5, D), 2)
    layer = model.decoder_layers[0]
    got = layer(
        jnp.float32(y),
        jnp.float32(memory),
        jnp.asarray(decoder_mask[:, None]),
        jnp.asarray(cross_mask[:, None]),
        deterministic=True,
    )
    expected = decoder_layer(y, memory, decoder_mask, cross_mask, layer, pre_layer_norm)
    # a padded query position's output is not used: compare the real ones
    real = b["targets"] != 0
    np.testing.assert_allclose(np.asarray(got)[real], expected[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "pre_layer_norm, use_bias",
    [(False, False), (True, False), (False, True)],
    ids=["post-LN", "pre-LN", "post-LN with attention biases"],
)
def test_whole_forward_pass(pre_layer_norm, use_bias):
    model = build(pre_layer_norm, layers=2, use_bias=use_bias)
    assert (model.encoder_layers[0].self_attention.query.bias is not None) == use_bias
    b = batch()
    got = np.asarray(model({k: jnp.asarray(v) for k, v in b.items()}))
    expected = forward(model, b["inputs"], b["targets"], pre_layer_norm)
    real = b["targets"] != 0
    np.testing.assert_allclose(got[real], expected[real], rtol=1e-4, atol=1e-4)


def swapped_layer_norm(self, x, y, *, deterministic):
    """Post-LN wired as LayerNorm(x) + Sublayer(x): the residual bypasses the norm."""
    return self.norm(x) + self.dropout(y, deterministic=deterministic)


def cross_attention_over_the_decoder(self, x, memory, self_mask, cross_mask, *, deterministic):
    """Encoder-decoder attention wired to the decoder's own states instead of the encoder's."""
    return ORIGINAL_DECODER_CALL(self, x, x, self_mask, jnp.ones_like(self_mask), deterministic=deterministic)


def without_feed_forward(self, x, *, deterministic=True):
    return jnp.zeros_like(x)


ORIGINAL_DECODER_CALL = transformer.DecoderLayer.__call__


@pytest.mark.parametrize(
    "target, attribute, broken",
    [
        (transformer.Residual, "outputs", swapped_layer_norm),
        (transformer.DecoderLayer, "__call__", cross_attention_over_the_decoder),
        (models.layers.FeedForward, "__call__", without_feed_forward),
    ],
    ids=["swapped LayerNorm", "mis-wired cross-attention", "missing FFN"],
)
def test_the_reference_catches_a_broken_model(monkeypatch, target, attribute, broken):
    model = build(pre_layer_norm=False, layers=2)
    b = batch()
    monkeypatch.setattr(target, attribute, broken)
    got = np.asarray(model({k: jnp.asarray(v) for k, v in b.items()}))
    real = b["targets"] != 0
    assert not np.allclose(got[real], forward(model, b["inputs"], b["targets"], False)[real], rtol=1e-4, atol=1e-4)
