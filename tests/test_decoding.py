"""Greedy and beam search: hand-built cases, equivalences, the length penalty, batching."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import decoding
import models
from vocabularies import BOS_ID, EOS_ID

A, B = 3, 4  # the two word tokens of the hand-built model


class MarkovModel:
    """A hand-built model: the next-token distribution depends only on the previous token.

    From bos: a 0.6, b 0.4. After a: eos 0.5, a 0.25, b 0.25. After b: eos 0.9, a 0.05, b 0.05.
    Greedy takes a, then eos: P = 0.30. The best sequence is b, eos: P = 0.36.
    """

    table = {BOS_ID: {A: 0.6, B: 0.4}, A: {EOS_ID: 0.5, A: 0.25, B: 0.25}, B: {EOS_ID: 0.9, A: 0.05, B: 0.05}}

    def __init__(self, vocab=5):
        logits = np.full((vocab, vocab), -30.0)
        for previous, following in self.table.items():
            for token, p in following.items():
                logits[previous, token] = math.log(p)
        self.logits = jnp.asarray(logits, jnp.float32)

    def encode(self, inputs):
        return inputs

    def init_decode_state(self, memory, batch_size, max_len):
        return jnp.zeros((batch_size,), jnp.int32)  # nothing to remember; shaped like a per-row state

    def decode_step(self, memory, token, state):
        return self.logits[token], state


def test_beam_search_finds_what_greedy_misses():
    inputs = jnp.ones((1, 3), jnp.int32)
    limits = jnp.array([5])
    greedy, greedy_score = decoding.greedy_search(MarkovModel(), inputs, limits, 5)
    np.testing.assert_array_equal(greedy[0, :2], [A, EOS_ID])
    assert float(greedy_score[0]) == pytest.approx(math.log(0.6 * 0.5), rel=1e-5)
    beam, beam_score = decoding.beam_search(MarkovModel(), inputs, limits, 5, beam_size=2, alpha=0.0)
    np.testing.assert_array_equal(beam[0], [B, EOS_ID, 0, 0, 0])
    assert float(beam_score[0]) == pytest.approx(math.log(0.4 * 0.9), rel=1e-5)


def test_length_limit_forces_eos():
    tokens, _ = decoding.greedy_search(MarkovModel(), jnp.ones((2, 3), jnp.int32), jnp.array([1, 3]), 5)
    np.testing.assert_array_equal(tokens, [[EOS_ID, 0, 0, 0, 0], [A, EOS_ID, 0, 0, 0]])


def test_length_penalty_formula():
    assert float(decoding.length_penalty(1.0, 0.6)) == pytest.approx(1.0)
    assert float(decoding.length_penalty(7.0, 1.0)) == pytest.approx(2.0)
    assert float(decoding.length_penalty(10.0, 0.6)) == pytest.approx((15 / 6) ** 0.6)
    assert float(decoding.length_penalty(10.0, 0.0)) == 1.0


# ------------------------------------------------------------ with the Transformer


@pytest.fixture(scope="module")
def transformer():
    return models.create_model(
        "transformer", rngs=nnx.Rngs(3), vocab_size=12, d_model=32, num_heads=4, d_ff=64,
        num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sources():
    rng = np.random.default_rng(0)
    inputs = rng.integers(3, 12, size=(3, 7))
    inputs[1, 4:] = 0
    inputs[2, 2:] = 0
    return jnp.asarray(inputs, jnp.int32)


def run(search, model, inputs, **kwargs):
    limits = decoding.source_lengths(inputs) + 4
    return jax.jit(lambda x: search(model, x, limits, 12, **kwargs))(inputs)


@pytest.mark.parametrize("search,kwargs", [(decoding.greedy_search, {}), (decoding.beam_search, {"beam_size": 3, "alpha": 0.6})])
def test_cached_decoding_equals_uncached(transformer, sources, search, kwargs):
    cached_tokens, cached_scores = run(search, transformer, sources, **kwargs)
    uncached_tokens, uncached_scores = run(search, decoding.WithoutCache(transformer), sources, **kwargs)
    np.testing.assert_array_equal(cached_tokens, uncached_tokens)
    np.testing.assert_allclose(cached_scores, uncached_scores, rtol=1e-4, atol=1e-5)


def test_beam_of_one_equals_greedy(transformer, sources):
    greedy_tokens, greedy_scores = run(decoding.greedy_search, transformer, sources)
    beam_tokens, beam_scores = run(decoding.beam_search, transformer, sources, beam_size=1, alpha=0.0)
    np.testing.assert_array_equal(beam_tokens, greedy_tokens)
    np.testing.assert_allclose(beam_scores, greedy_scores, rtol=1e-5)


def test_beam_score_is_the_normalised_log_probability(transformer, sources):
    tokens, scores = run(decoding.beam_search, transformer, sources, beam_size=4, alpha=0.6)
    log_probs = jax.nn.log_softmax(transformer({"inputs": sources, "targets": tokens}))
    for row in range(3):
        length = int(np.argmax(np.asarray(tokens[row]) == EOS_ID)) + 1
        total = sum(float(log_probs[row, t, tokens[row, t]]) for t in range(length))
        assert float(scores[row]) == pytest.approx(total / ((5 + length) / 6) ** 0.6, rel=1e-4)
    greedy_tokens, greedy_scores = run(decoding.greedy_search, transformer, sources)
    greedy_lengths = np.argmax(np.asarray(greedy_tokens) == EOS_ID, axis=1) + 1
    assert np.all(np.asarray(scores) >= np.asarray(greedy_scores) / ((5 + greedy_lengths) / 6) ** 0.6 - 1e-5)


@pytest.mark.parametrize("search,kwargs", [(decoding.greedy_search, {}), (decoding.beam_search, {"beam_size": 3, "alpha": 0.6})])
def test_padded_batch_equals_each_example_alone(transformer, sources, search, kwargs):
    batch_tokens, batch_scores = run(search, transformer, sources, **kwargs)
    for row in range(3):
        length = int((sources[row] > 0).sum())
        alone_tokens, alone_scores = run(search, transformer, sources[row : row + 1, :length], **kwargs)
        np.testing.assert_array_equal(alone_tokens[0], batch_tokens[row])
        np.testing.assert_allclose(alone_scores[0], batch_scores[row], rtol=1e-4, atol=1e-5)
