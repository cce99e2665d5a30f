"""Show, Attend and Tell (Xu et al. 2015) against float64 NumPy steps written from its equations,
its hard-attention gradient estimator against the enumerated exact gradient, and its penalty."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import metrics
import models
from errors import ConfigError
from models.captioner import doubly_stochastic_penalty, hard_attention_terms
from references import np_log_softmax, np_softmax

V, E, N, A, D, L = 11, 5, 6, 4, 3, 5


def make(**fields):
    sizes = dict(vocab_size=V, embed_dim=E, hidden_dim=N, attention_dim=A, inputs="features", feature_dim=D)
    return models.create_model("captioner", rngs=nnx.Rngs(params=0, dropout=1), **{**sizes, **fields})


def f64(x):
    return np.asarray(x[...] if hasattr(x, "get_value") else x, np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def dense(layer, x):
    out = x @ f64(layer.kernel)
    return out + f64(layer.bias) if layer.bias is not None else out


def reference_step(model, annotations, word, hidden, cell, location=None):
    """One decoder step of section 3.1.2 in float64 from the model's weights: `(logits, h_t, c_t,
    alpha_t)`. Soft attention (eqs. 4-6, z = beta sum_i alpha_i a_i), or hard attention's context
    `z = beta a_s` at a fixed `location` s."""
    scores = np.tanh(dense(model.attention.key_proj, annotations) + hidden[:, None] @ f64(model.attention.query_proj.kernel)) @ f64(model.attention.v)
    alpha = np_softmax(scores)  # eqs. 4-5
    beta = sigmoid(dense(model.beta, hidden))  # section 4.2.1
    if location is None:
        z = beta * np.einsum("bl,bld->bd", alpha, annotations)
    else:
        z = beta * annotations[np.arange(len(location)), location]
    embedded = f64(model.embed.embedding)[word]
    gates = dense(model.lstm.input_proj, np.concatenate([embedded, z], -1)) + hidden @ f64(model.lstm.hidden_proj.kernel)
    i, f, o, g = np.split(gates, 4, -1)  # eq. 1
    cell = sigmoid(f) * cell + sigmoid(i) * np.tanh(g)  # eq. 2
    hidden = sigmoid(o) * np.tanh(cell)  # eq. 3
    deep = embedded + dense(model.output_hidden, hidden) + z @ f64(model.output_context.kernel)
    return dense(model.output, deep), hidden, cell, alpha  # eq. 7


def reference_start(model, annotations):
    mean = annotations.mean(axis=1)
    return np.tanh(dense(model.init_hidden, mean)), np.tanh(dense(model.init_cell, mean))


def test_soft_decoder_steps_are_the_papers_equations():
    model = make()
    annotations = np.random.default_rng(0).normal(size=(2, L, D))
    memory = model.encode(jnp.float32(annotations))
    state = model.init_decode_state(memory, 2, 4)
    hidden, cell = reference_start(model, annotations)
    np.testing.assert_allclose(state.lstm.hidden, hidden, rtol=1e-5, atol=1e-6)
    for word in ([1, 1], [4, 7], [9, 2]):
        logits, state = model.decode_step(memory, jnp.asarray(word), state)
        expected, hidden, cell, _ = reference_step(model, annotations, np.asarray(word), hidden, cell)
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state.lstm.cell, cell, rtol=1e-4, atol=1e-5)


def test_hard_attention_pass_reads_the_sampled_locations():
    """A teacher-forced hard-attention pass at fixed locations equals the reference with z = beta a_s,
    and its sampled locations follow alpha (the most likely location wins most often)."""
    model = make(attention="hard")
    rng = np.random.default_rng(1)
    annotations = rng.normal(size=(2, L, D))
    targets = np.array([[3, 5, 2], [4, 2, 0]])
    locations = np.array([[0, 4, 2], [3, 3, 1]])
    batch = {"inputs": jnp.float32(annotations), "targets": jnp.asarray(targets)}
    out = model.teacher_forced(batch, locations=jnp.asarray(locations))
    hidden, cell = reference_start(model, annotations)
    previous = np.ones(2, int)
    for t in range(3):
        expected, hidden, cell, alpha = reference_step(model, annotations, previous, hidden, cell, locations[:, t])
        np.testing.assert_allclose(out["logits"][:, t], expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out["weights"][:, t], alpha, rtol=1e-4, atol=1e-6)
        previous = targets[:, t]
    draws = jax.vmap(lambda key: model.teacher_forced(batch, key=key)["locations"][:, 0])(jax.random.split(jax.random.key(0), 2000))
    frequencies = np.stack([np.bincount(np.asarray(draws[:, row]), minlength=L) / 2000 for row in range(2)])
    np.testing.assert_allclose(frequencies, out["weights"][:, 0], atol=0.04)  # s_1 ~ alpha_1 (eq. 8)


def test_hard_attention_estimator_is_unbiased():
    """The gradient of `Captioner.objective` (section 4.1's learning rule: REINFORCE with a baseline;
    the expectation trick, the entropy term and the penalty off) averaged over many samples equals
    the exact gradient of L_s = sum_s p(s|a) log p(y|s,a) (eq. 10), enumerated over all L^T location
    sequences of a tiny problem."""
    model = make(attention="hard", embed_dim=3, hidden_dim=3, attention_dim=3, vocab_size=5,
                 expectation_probability=0.0, entropy_weight=0.0, doubly_stochastic=0.0)  # the rule alone
    locations_count, steps = 3, 2
    annotations = jnp.float32(np.random.default_rng(2).normal(size=(1, locations_count, D)) * 2)
    batch = {"inputs": annotations, "targets": jnp.asarray([[3, 2]])}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    real = jnp.ones((1, steps))

    def terms(params, **how):
        out = nnx.merge(graphdef, params, rest).teacher_forced(batch, **how)
        return hard_attention_terms(out["logits"], out["weights"], out["locations"], batch["targets"], real)

    def exact_objective(params):
        total = 0.0
        for sequence in itertools.product(range(locations_count), repeat=steps):
            t = terms(params, locations=jnp.asarray([sequence]))
            total += jnp.exp(t["log_locations"][0]) * t["log_likelihood"][0]
        return total

    baseline = {"baseline": jnp.float32(-1.3)}  # any constant: it shifts the estimate's variance, not its mean

    def estimate(key):  # the gradient the trainer takes: of minus the model's own objective
        def objective(params):
            loss, _, _ = nnx.merge(graphdef, params, rest).objective(batch, baseline, key, metrics.token_sums)
            return -loss

        return jax.grad(objective)(params)

    exact = jax.grad(exact_objective)(params)
    samples = jax.jit(jax.vmap(estimate))(jax.random.split(jax.random.key(3), 20_000))
    checked = 0
    for want, got in zip(jax.tree.leaves(exact), jax.tree.leaves(samples)):
        mean, error = np.mean(got, axis=0), np.std(got, axis=0) / np.sqrt(got.shape[0])
        np.testing.assert_array_less(np.abs(mean - np.asarray(want)), 5 * error + 1e-4)  # within 5 standard errors
        checked += np.sum(np.abs(np.asarray(want)) > 10 * error)
    assert checked > 10  # enough coordinates whose gradient stands out of the noise (not a vacuous check)


def test_baseline_moves_as_the_paper_says():
    """b_k = 0.9 b_{k-1} + 0.1 log p(y | s_k, a), the log-likelihood of the sampled pass."""
    model = make(attention="hard", expectation_probability=0.0)
    batch = {"inputs": jnp.float32(np.random.default_rng(4).normal(size=(3, L, D))), "targets": jnp.asarray([[3, 5, 2], [4, 2, 0], [6, 2, 0]])}
    key = jax.random.key(5)
    _, _, state = model.objective(batch, {"baseline": jnp.float32(-2.0)}, key, metrics.token_sums)
    out = model.teacher_forced(batch, key=jax.random.split(key)[1])
    log_probs = np_log_softmax(np.asarray(out["logits"], np.float64))
    targets = np.asarray(batch["targets"])
    picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0] * (targets != 0)
    np.testing.assert_allclose(state["baseline"], 0.9 * -2.0 + 0.1 * picked.sum(-1).mean(), rtol=1e-5)


def test_teacher_forcing_equals_decoding_step_by_step():
    """The training pass with the expected context (soft attention, and hard attention's decoding)
    is the decoder's steps run one by one on the reference; from pixels, through the CNN."""
    model = models.create_model("captioner", rngs=nnx.Rngs(0), vocab_size=V, conv_widths=(4, 4), pools=1, embed_dim=E,
                                hidden_dim=N, attention_dim=A)  # fmt: skip
    images = jnp.asarray(np.random.default_rng(6).integers(0, 256, size=(2, 6, 8, 1)), jnp.uint8)
    targets = jnp.asarray([[3, 5, 2, 0], [4, 6, 7, 2]])
    logits = model({"inputs": images, "targets": targets})
    memory = model.encode(images)
    assert memory.annotations.shape == (2, 3 * 4, 4)  # the 3 x 4 grid of a 6 x 8 image after one pool
    state, previous = model.init_decode_state(memory, 2, 4), jnp.ones(2, jnp.int32)
    for t in range(4):
        step_logits, state = model.decode_step(memory, previous, state)
        np.testing.assert_allclose(step_logits, logits[:, t], rtol=1e-5, atol=1e-5)
        previous = targets[:, t]


def test_doubly_stochastic_penalty():
    weights = np.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.9, 0.05, 0.05]]])  # [1, T=3, L=3]
    real = np.array([[1.0, 1.0, 0.0]])  # the third step is padding
    totals = np.array([0.6, 1.05, 0.35])  # sum over the real steps, by hand
    np.testing.assert_allclose(doubly_stochastic_penalty(jnp.asarray(weights), jnp.asarray(real)), [np.sum((1 - totals) ** 2)], rtol=1e-6)
    permutation = jnp.eye(4)[jnp.asarray([2, 0, 3, 1])][None]  # each location attended once over time
    assert float(doubly_stochastic_penalty(permutation, jnp.ones((1, 4)))[0]) == 0.0


def test_bad_fields_are_named():
    with pytest.raises(ConfigError, match="model.attention must be one of soft, hard"):
        make(attention="spotlight")
    with pytest.raises(ConfigError, match="model.feature_dim"):
        make(feature_dim=0)
