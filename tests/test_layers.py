"""Embeddings, positional encodings, feed-forward and shift_right against the paper's formulas."""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import Embed, FeedForward, shift_right, sinusoidal_encoding


def test_sinusoidal_encoding_equals_the_papers_formula():
    d_model, length = 16, 50
    codes = np.asarray(sinusoidal_encoding(jnp.arange(length), d_model))
    expected = np.zeros((length, d_model))
    for pos in range(length):
        # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)
        for i in range(d_model // 2):
            expected[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d_model))
            expected[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d_model))
    np.testing.assert_allclose(codes, expected, rtol=1e-5, atol=2e-5)


def test_sinusoidal_encoding_follows_packed_positions():
    positions = jnp.array([[0, 1, 2, 0, 1]])
    codes = sinusoidal_encoding(positions, 8)
    np.testing.assert_array_equal(codes[0, 3:], codes[0, :2])


def test_embedding_is_scaled_by_sqrt_d_model():
    embed = Embed(11, 16, rngs=nnx.Rngs(0))
    table = np.asarray(embed.embedding.embedding[...])
    tokens = jnp.array([[3, 0, 10]])
    np.testing.assert_allclose(embed(tokens)[0], table[[3, 0, 10]] * 4.0, rtol=1e-6)
    unscaled = Embed(11, 16, scale=False, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(unscaled(tokens)[0], table[[3, 0, 10]], rtol=1e-6)


def test_embedding_attend_is_the_transposed_table():
    embed = Embed(11, 16, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(2, 3, 16)).astype(np.float32)
    table = np.float64(embed.embedding.embedding[...])
    np.testing.assert_allclose(embed.attend(x), np.float64(x) @ table.T, rtol=1e-5, atol=1e-5)


def test_feed_forward_is_relu_between_two_affine_maps():
    ffn = FeedForward(6, 10, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).normal(size=(2, 3, 6))
    w1, b1 = np.float64(ffn.inner.kernel[...]), np.float64(ffn.inner.bias[...])
    w2, b2 = np.float64(ffn.outer.kernel[...]), np.float64(ffn.outer.bias[...])
    expected = np.maximum(0, x @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(ffn(x.astype(np.float32)), expected, rtol=1e-5, atol=1e-5)


def test_shift_right_hand_worked():
    targets = jnp.array([[5, 6, 7, 2], [8, 2, 0, 0]])
    np.testing.assert_array_equal(shift_right(targets, bos_id=1), [[1, 5, 6, 7], [1, 8, 2, 0]])


def test_shift_right_restarts_each_packed_segment():
    targets = jnp.array([[5, 6, 2, 7, 2, 0]])
    segments = jnp.array([[1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(shift_right(targets, 1, segments), [[1, 5, 6, 1, 7, 1]])
