"""The Transformer: causality, packing, cached decoding, sizes, and the registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.attention import AttentionWeights

VOCAB = 23


@nnx.jit(static_argnames="deterministic")
def forward(model, batch, deterministic=True):
    """One compiled forward pass per model and shape; eager dispatch would dominate the test time."""
    return model(batch, deterministic=deterministic)


def tiny(**overrides):
    fields = dict(
        vocab_size=VOCAB, d_model=16, num_heads=4, d_ff=32, num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.1
    )
    fields.update(overrides)
    return models.create_model("transformer", rngs=nnx.Rngs(0), **fields)


def random_tokens(seed, shape, lengths):
    """Tokens in [3, VOCAB) with padding (0) after each row's length."""
    tokens = np.random.default_rng(seed).integers(3, VOCAB, shape)
    for row, length in enumerate(lengths):
        tokens[row, length:] = 0
    return jnp.array(tokens)


def test_decoder_is_causal():
    model = tiny()
    inputs = random_tokens(0, (2, 7), [7, 5])
    targets = random_tokens(1, (2, 6), [6, 6])
    logits = forward(model, {"inputs": inputs, "targets": targets})
    for i in range(5):
        perturbed = targets.at[:, i + 1 :].set((targets[:, i + 1 :] + 5) % (VOCAB - 3) + 3)
        perturbed_logits = forward(model, {"inputs": inputs, "targets": perturbed})
        # logits at position p depend on targets < p only (teacher forcing shifts right)
        np.testing.assert_allclose(perturbed_logits[:, : i + 2], logits[:, : i + 2], rtol=1e-5, atol=1e-5)
        if i + 2 < targets.shape[1]:
            assert not np.allclose(perturbed_logits[:, i + 2 :], logits[:, i + 2 :])


def test_source_padding_is_ignored():
    model = tiny()
    inputs = random_tokens(2, (1, 6), [4])
    targets = random_tokens(3, (1, 5), [5])
    short = forward(model, {"inputs": inputs[:, :4], "targets": targets})
    padded = forward(model, {"inputs": inputs, "targets": targets})
    np.testing.assert_allclose(padded, short, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pre_layer_norm", [False, True])
def test_packed_row_equals_its_segments_run_separately(pre_layer_norm):
    model = tiny(pre_layer_norm=pre_layer_norm)
    src_a, src_b = random_tokens(4, (1, 4), [4]), random_tokens(5, (1, 3), [3])
    tgt_a, tgt_b = random_tokens(6, (1, 3), [3]), random_tokens(7, (1, 5), [5])
    packed = {
        "inputs": jnp.concatenate([src_a, src_b, jnp.zeros((1, 2), int)], axis=1),
        "inputs_segment_ids": jnp.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]]),
        "inputs_positions": jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]]),
        "targets": jnp.concatenate([tgt_a, tgt_b, jnp.zeros((1, 1), int)], axis=1),
        "targets_segment_ids": jnp.array([[1, 1, 1, 2, 2, 2, 2, 2, 0]]),
        "targets_positions": jnp.array([[0, 1, 2, 0, 1, 2, 3, 4, 0]]),
    }
    logits = forward(model, packed)
    np.testing.assert_allclose(logits[:, :3], forward(model, {"inputs": src_a, "targets": tgt_a}), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[:, 3:8], forward(model, {"inputs": src_b, "targets": tgt_b}), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"pre_layer_norm": True, "positional": "learned", "tie_output": False, "share_embeddings": False},
        {"score": "additive"},
    ],
)
def test_cached_decoding_reproduces_teacher_forced_logits(overrides):
    model = tiny(**overrides)
    inputs = random_tokens(8, (2, 7), [7, 4])
    targets = random_tokens(9, (2, 6), [6, 4])
    teacher_forced = forward(model, {"inputs": inputs, "targets": targets})
    memory = model.encode(inputs)
    state = model.init_decode_state(memory, batch_size=2, max_len=8)
    token = jnp.full((2,), model.config.bos_id)
    steps = []
    for t in range(6):
        logits, state = model.decode_step(memory, token, state)
        steps.append(logits)
        token = targets[:, t]
    decoded = jnp.stack(steps, axis=1)
    np.testing.assert_allclose(decoded[0], teacher_forced[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(decoded[1, :4], teacher_forced[1, :4], rtol=1e-5, atol=1e-5)


def test_cached_decoding_under_jit():
    model = tiny()
    inputs = random_tokens(10, (2, 5), [5, 5])
    graphdef, params = nnx.split(model)

    @jax.jit
    def greedy(params, inputs):
        model = nnx.merge(graphdef, params)
        memory = model.encode(inputs)

        def step(carry, _):
            token, state = carry
            logits, state = model.decode_step(memory, token, state)
            next_token = jnp.argmax(logits[:, 3:], -1) + 3  # no pad/bos/eos: teacher forcing would mask pads
            return (next_token, state), next_token

        start = (jnp.full((2,), 1), model.init_decode_state(memory, 2, 4))
        return jax.lax.scan(step, start, length=4)[1].T

    tokens = greedy(params, inputs)
    teacher_forced = forward(model, {"inputs": inputs, "targets": tokens})
    np.testing.assert_array_equal(jnp.argmax(teacher_forced[..., 3:], -1) + 3, tokens)


def test_dropout_only_in_training():
    model = tiny(dropout_rate=0.3)
    batch = {"inputs": random_tokens(11, (2, 5), [5, 5]), "targets": random_tokens(12, (2, 4), [4, 4])}
    np.testing.assert_array_equal(forward(model, batch), forward(model, batch))
    assert not np.allclose(forward(model, batch, deterministic=False), forward(model, batch))


def test_bfloat16_compute_keeps_float32_params_and_logits():
    model32, model16 = tiny(), tiny(dtype="bfloat16")
    params = jax.tree.leaves(nnx.state(model16, nnx.Param))
    assert all(p.dtype == jnp.float32 for p in params)
    batch = {"inputs": random_tokens(13, (2, 5), [5, 3]), "targets": random_tokens(14, (2, 4), [4, 2])}
    logits16, logits32 = forward(model16, batch), forward(model32, batch)
    assert logits16.dtype == jnp.float32
    # same parameters (same seed), bfloat16 activations: close but not equal
    np.testing.assert_allclose(logits16, logits32, atol=0.15)
    assert not np.array_equal(logits16, logits32)


def test_capture_returns_every_layers_attention_weights():
    model = tiny()
    batch = {"inputs": random_tokens(15, (1, 5), [3]), "targets": random_tokens(16, (1, 4), [4])}
    logits, recorded = nnx.capture(model, AttentionWeights)(batch)
    np.testing.assert_allclose(logits, forward(model, batch), rtol=1e-5, atol=1e-5)
    (cross,) = recorded["decoder_layers"][1]["cross_attention"]["attention_weights"].get_value()
    assert cross.shape == (1, 4, 4, 5)  # [B, N, T, S]
    assert np.all(np.asarray(cross)[..., 3:] == 0.0)  # source padding
    np.testing.assert_allclose(np.asarray(cross).sum(-1), 1.0, rtol=1e-5)
    (self_weights,) = recorded["decoder_layers"][0]["self_attention"]["attention_weights"].get_value()
    assert np.all(np.triu(np.asarray(self_weights)[0, 0], k=1) == 0.0)  # causal


def count_params(**fields) -> int:
    """Counts every parameter once (the shared embedding once), without allocating them."""
    abstract = nnx.eval_shape(lambda: models.create_model("transformer", rngs=nnx.Rngs(0), **fields))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def test_parameter_counts_match_the_paper():
    # Vaswani et al. table 3: base 65M, big 213M, with a shared 37000-token
    # source/target vocabulary whose embedding is also the output projection.
    # The count: all weights of the attention projections and their biases (query,
    # value, output; keys have none), the feed-forward layers and the LayerNorms,
    # and the one embedding matrix.
    base = count_params(vocab_size=37000)
    big = count_params(vocab_size=37000, d_model=1024, num_heads=16, d_ff=4096)
    assert abs(base / 65e6 - 1) < 0.03, base
    assert abs(big / 213e6 - 1) < 0.03, big
    # and by hand: embedding + 6 encoder layers + 6 decoder layers
    d, f, v = 512, 2048, 37000
    attention, ffn = 4 * d * d + 3 * d, 2 * d * f + f + d
    assert base == v * d + 6 * (attention + ffn + 4 * d) + 6 * (2 * attention + ffn + 6 * d)


def test_registry_names_unknown_models_and_fields():
    with pytest.raises(ValueError, match="unknown model.name 'transfomer'; valid: luong, rnnencdec, rnnsearch, transformer"):
        models.create_model("transfomer", rngs=nnx.Rngs(0), vocab_size=5)
    with pytest.raises(ValueError, match="unknown field.*d_modle"):
        models.create_model("transformer", rngs=nnx.Rngs(0), vocab_size=5, d_modle=8)
    with pytest.raises(ValueError, match="model.dtype"):
        models.create_model("transformer", rngs=nnx.Rngs(0), vocab_size=5, dtype="float16")
