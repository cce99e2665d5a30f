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
    np.testing.assert_allclose(
        logits[:, 3:8], forward(model, {"inputs": src_b, "targets": tgt_b}), rtol=1e-5, atol=1e-5
    )


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
            # no pad/bos/eos: teacher forcing would mask pads
            next_token = jnp.argmax(logits[:, 3:], -1) + 3
            return (next_token, state), next_token

        start = (jnp.full((2,), 1), model.init_decode_state(memory, 2, 4))
        return jax.lax.scan(step, start, length=4)[1].T

    tokens = greedy(params, inputs)
    teacher_forced = forward(model, {"inputs": inputs, "targets": tokens})
    np.testing.assert_array_equal(jnp.argmax(teacher_forced[..., 3:], -1) + 3, tokens)


def dropout_rates(model) -> list[float]:
    return sorted(m.rate for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Dropout))


def test_dropout_only_in_training_at_the_configured_rates():
    model = tiny(dropout_rate=0.3, attention_dropout_rate=0.2, relu_dropout_rate=0.1)
    # Section 5.4: residual dropout on each sub-layer's output (2 per encoder layer, 3 per decoder
    # layer) and on the embedding sums; attention and ReLU dropout one per attention / FFN.
    assert dropout_rates(model) == sorted([0.3] * (2 * 2 + 3 * 2 + 1) + [0.2] * (2 + 2 * 2) + [0.1] * (2 + 2))
    batch = {"inputs": random_tokens(11, (2, 5), [5, 5]), "targets": random_tokens(12, (2, 4), [4, 4])}
    # deterministic: no dropout
    np.testing.assert_array_equal(forward(model, batch), forward(model, batch))
    training = forward(model, batch, deterministic=False)
    assert not np.allclose(training, forward(model, batch))
    # with every rate 0, training mode is the deterministic pass: dropout is the only difference
    quiet = tiny(dropout_rate=0.0)
    np.testing.assert_allclose(forward(quiet, batch, deterministic=False), forward(quiet, batch), rtol=1e-6, atol=1e-6)


def test_bfloat16_computes_in_bfloat16_with_float32_params_and_logits():
    model32, model16 = tiny(), tiny(dtype="bfloat16")
    params = jax.tree.leaves(nnx.state(model16, nnx.Param))
    assert all(p.dtype == jnp.float32 for p in params)
    batch = {"inputs": random_tokens(13, (2, 5), [5, 3]), "targets": random_tokens(14, (2, 4), [4, 2])}
    logits16, logits32 = forward(model16, batch), forward(model32, batch)
    assert logits16.dtype == jnp.float32
    # every matmul of the model takes bfloat16 operands (the einsums and the dense layers)
    graphdef, state = nnx.split(model16)
    hlo = jax.jit(lambda s, b: nnx.merge(graphdef, s)(b)).lower(state, batch).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    assert dots and all("xbf16>" in line.split("->")[0] for line in dots), [dot for dot in dots if "xbf16>" not in dot]
    # same parameters (same seed): the logits differ by bfloat16 rounding (8 bits of mantissa,
    # relative 2^-8 per operation, over a few layers), not more
    scale = np.abs(np.asarray(logits32)).max()
    error = np.abs(np.asarray(logits16) - np.asarray(logits32)).max()
    assert 0 < error < 0.05 * scale, (error, scale)


def test_capture_returns_every_layers_attention_weights():
    model = tiny()
    batch = {"inputs": random_tokens(15, (1, 5), [3]), "targets": random_tokens(16, (1, 4), [4])}
    # compiled: op by op, it compiled about 120 small programs
    logits, recorded = nnx.jit(lambda model, batch: nnx.capture(model, AttentionWeights)(batch))(model, batch)
    np.testing.assert_allclose(logits, forward(model, batch), rtol=1e-5, atol=1e-5)
    (cross,) = recorded["decoder_layers"][1]["cross_attention"]["attention_weights"].get_value()
    assert cross.shape == (1, 4, 4, 5)  # [B, N, T, S]
    # source padding
    assert np.all(np.asarray(cross)[..., 3:] == 0.0)
    np.testing.assert_allclose(np.asarray(cross).sum(-1), 1.0, rtol=1e-5)
    (self_weights,) = recorded["decoder_layers"][0]["self_attention"]["attention_weights"].get_value()
    # causal
    assert np.all(np.triu(np.asarray(self_weights)[0, 0], k=1) == 0.0)


def count_params(**fields) -> int:
    """Counts every parameter once (the shared embedding once), without allocating them."""
    abstract = nnx.eval_shape(lambda: models.create_model("transformer", rngs=nnx.Rngs(0), **fields))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def paper_parameter_count(vocab: int, d: int, d_ff: int, layers: int) -> int:
    """The parameters of Vaswani et al. section 3, counted from the paper alone.

    One embedding matrix `[vocab, d]`, shared by both embedding layers and the pre-softmax
    projection (section 3.4). Each of `layers` encoder layers: multi-head self-attention with
    per-head projections W^Q_i, W^K_i, W^V_i (d x d_k, d_v, with h d_k = d) and W^O (d x d), so
    4 d^2 (section 3.2.2); the FFN's W_1, b_1, W_2, b_2 (eq. 2); two LayerNorms with a gain and a
    bias each. Each decoder layer: two multi-head attentions, the FFN, three LayerNorms.
    The paper names no attention biases; positions are sinusoidal, without parameters.
    """
    attention = 4 * d * d
    ffn = d * d_ff + d_ff + d_ff * d + d
    norm = 2 * d
    return vocab * d + layers * (attention + ffn + 2 * norm) + layers * (2 * attention + ffn + 3 * norm)


@pytest.mark.parametrize(
    "sizes, paper_millions",
    [(dict(d_model=512, num_heads=8, d_ff=2048), 65), (dict(d_model=1024, num_heads=16, d_ff=4096), 213)],
    ids=["base", "big"],
)
def test_parameter_counts_match_the_paper(sizes, paper_millions):
    # Table 3: base 65M, big 213M parameters, with a shared vocabulary of about 37000 tokens.
    vocab, d = 37000, sizes["d_model"]
    counted = count_params(vocab_size=vocab, **sizes)
    paper = paper_parameter_count(vocab, d, sizes["d_ff"], layers=6)
    # As the paper: no attention biases. With `use_bias` the model adds biases on the query, value
    # and output projections of each attention (3 d per attention, 3 attentions per encoder-decoder
    # layer pair); never a key bias (softmax ignores it).
    assert counted == paper
    assert count_params(vocab_size=vocab, use_bias=True, **sizes) - paper == 6 * 3 * (3 * d)
    # The paper's figures are rounded to millions, and its vocabulary is "about 37000" BPE tokens:
    # the formula gives 63.1M for base (65M would need about 40,700 tokens) and 214.1M for big.
    assert abs(paper / (paper_millions * 1e6) - 1) < 0.035, paper


def test_registry_names_unknown_models_and_fields():
    with pytest.raises(
        ValueError,
        match="unknown model.name 'transfomer'; valid: captioner, lstmn, luong, rnnencdec, rnnsearch, transformer",
    ):
        models.create_model("transfomer", rngs=nnx.Rngs(0), vocab_size=5)
    with pytest.raises(ValueError, match="unknown field.*d_modle"):
        models.create_model("transformer", rngs=nnx.Rngs(0), vocab_size=5, d_modle=8)
    with pytest.raises(ValueError, match="model.dtype"):
        models.create_model("transformer", rngs=nnx.Rngs(0), vocab_size=5, dtype="float16")
