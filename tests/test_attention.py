"""Attention math and modules against float64 NumPy references and hand-worked masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from helpers.references import np_masked_softmax
from models import attention
from models.attention import Attention, AttentionWeights, MultiHeadAttention

# float32 against float64: 1e-5 relative, tiny absolute floor near 0
RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------- references


def np_dot_scores(q, k):  # [B,T,N,H],[B,S,N,H] -> [B,N,T,S], by explicit loops over b, n
    q, k = np.float64(q), np.float64(k)
    b_, t_, n_, _ = q.shape
    out = np.zeros((b_, n_, t_, k.shape[1]))
    for b in range(b_):
        for n in range(n_):
            out[b, n] = q[b, :, n, :] @ k[b, :, n, :].T
    return out


def np_general_scores(q, k, w):
    q, k, w = np.float64(q), np.float64(k), np.float64(w)
    out = np.zeros((q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    for b in range(q.shape[0]):
        for n in range(q.shape[2]):
            out[b, n] = q[b, :, n, :] @ w[n] @ k[b, :, n, :].T
    return out


def np_additive_scores(qp, kp, v):
    qp, kp, v = np.float64(qp), np.float64(kp), np.float64(v)
    out = np.zeros((qp.shape[0], qp.shape[2], qp.shape[1], kp.shape[1]))
    for b in range(qp.shape[0]):
        for n in range(qp.shape[2]):
            for i in range(qp.shape[1]):
                out[b, n, i] = np.tanh(qp[b, i, n][None, :] + kp[b, :, n]) @ v[n]
    return out


def np_attention(q, k, v, mask, scale):
    weights = np_masked_softmax(np_dot_scores(q, k) * scale, mask)
    return np.einsum("bnts,bsnh->btnh", weights, np.float64(v)), weights


def random_qkv(seed=0, b=2, t=5, s=7, n=3, h=4):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, s, n, h)).astype(np.float32)
    v = rng.normal(size=(b, s, n, h)).astype(np.float32)
    return q, k, v


def random_mask(seed=0, b=2, n=3, t=5, s=7, empty_row=(0, 1, 2)):
    """Random mask with one fully masked query row at (batch, head, query) = empty_row."""
    mask = np.random.default_rng(seed + 100).random((b, n, t, s)) > 0.4
    # every other row sees at least one key
    mask[..., 0] = True
    mask[empty_row] = False
    return mask


# --------------------------------------------------------------------- masks


def test_padding_mask_hand_worked():
    mask = attention.padding_mask(jnp.array([[5, 7, 0]]), jnp.array([[5, 0]]))
    expected = np.array([[[[True, False], [True, False], [False, False]]]])
    np.testing.assert_array_equal(mask, expected)


def test_causal_mask_hand_worked():
    expected = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1]], bool)[None, None]
    np.testing.assert_array_equal(attention.causal_mask(3), expected)


def test_segment_mask_hand_worked():
    mask = attention.segment_mask(jnp.array([[1, 1, 2, 0]]), jnp.array([[1, 1, 2, 0]]))
    expected = np.array(
        [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]],
        bool,
    )
    np.testing.assert_array_equal(mask[0, 0], expected)


def test_combine_masks_is_logical_and_and_skips_none():
    causal = attention.causal_mask(3)
    pad = attention.padding_mask(jnp.array([[1, 1, 0]]), jnp.array([[1, 1, 0]]))
    combined = attention.combine_masks(causal, None, pad)
    expected = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0]], bool)
    np.testing.assert_array_equal(combined[0, 0], expected)
    assert attention.combine_masks(None, None) is None


# ------------------------------------------------------------ score functions


def test_dot_scores_match_numpy():
    q, k, _ = random_qkv()
    np.testing.assert_allclose(attention.dot_scores(q, k), np_dot_scores(q, k), rtol=RTOL, atol=ATOL)


def test_general_scores_match_numpy():
    q, k, _ = random_qkv()
    w = np.random.default_rng(3).normal(size=(3, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(attention.general_scores(q, k, w), np_general_scores(q, k, w), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("q_len,chunk", [(5, 64), (11, 4), (12, 4)])
def test_additive_scores_match_numpy_chunked_or_not(q_len, chunk):
    q, k, _ = random_qkv(t=q_len)
    v = np.random.default_rng(4).normal(size=(3, 4)).astype(np.float32)
    scores = attention.additive_scores(q, k, v, query_chunk_size=chunk)
    np.testing.assert_allclose(scores, np_additive_scores(q, k, v), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("masked", [False, True])
def test_scaled_dot_product_attention_matches_numpy(masked):
    q, k, v = random_qkv()
    mask = random_mask() if masked else None
    out, weights = attention.scaled_dot_product_attention(q, k, v, mask)
    ref_out, ref_weights = np_attention(q, k, v, mask, 1 / np.sqrt(4))
    np.testing.assert_allclose(weights, ref_weights, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL)


def test_explicit_scale_is_used():
    q, k, v = random_qkv()
    out, _ = attention.scaled_dot_product_attention(q, k, v, scale=0.3)
    np.testing.assert_allclose(out, np_attention(q, k, v, None, 0.3)[0], rtol=RTOL, atol=ATOL)


def test_masked_weights_exactly_zero_rows_sum_to_one_empty_row_zero():
    q, k, v = random_qkv()
    mask = random_mask()
    out, weights = attention.scaled_dot_product_attention(q, k, v, mask)
    weights = np.asarray(weights)
    assert np.all(weights[~mask] == 0.0)
    visible = mask.any(-1)
    np.testing.assert_allclose(weights.sum(-1)[visible], 1.0, rtol=1e-6)
    assert np.all(weights[0, 1, 2] == 0.0)
    # out is [B, T, N, H]
    assert np.all(np.asarray(out)[0, 2, 1] == 0.0)


def test_fully_masked_row_has_finite_gradients():
    q, k, v = random_qkv()
    mask = random_mask()

    def loss(q, k, v):
        out, _ = attention.scaled_dot_product_attention(q, k, v, mask)
        return jnp.sum(out**2)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(g))
    # the empty row's query gets no gradient
    assert np.all(np.asarray(grads[0])[0, 2, 1] == 0.0)


def test_fully_masked_row_with_additive_scores_is_finite():
    q, k, _ = random_qkv()
    v = np.ones((3, 4), np.float32)
    mask = np.zeros((2, 3, 5, 7), bool)
    weights = attention.masked_softmax(attention.additive_scores(q, k, v), mask)
    assert np.all(np.asarray(weights) == 0.0)


@pytest.mark.parametrize("masked", [False, True])
def test_library_path_equals_explicit_path(masked):
    q, k, v = random_qkv(seed=5)
    mask = random_mask(seed=5) if masked else None
    explicit, _ = attention.scaled_dot_product_attention(q, k, v, mask)
    library = attention.library_scaled_dot_product_attention(q, k, v, mask)
    np.testing.assert_allclose(library, explicit, rtol=1e-5, atol=1e-6)


def test_library_path_gradients_equal_explicit_path_gradients():
    # The library kernel computes in float32 even for float64 inputs, so it is
    # checked against the explicit path (itself checked by finite differences).
    q, k, v = random_qkv(seed=7)
    mask = random_mask(seed=7)
    loss = lambda attend: lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v, mask)))
    explicit = jax.grad(loss(lambda *a: attention.scaled_dot_product_attention(*a)[0]), argnums=(0, 1, 2))(q, k, v)
    library = jax.grad(loss(attention.library_scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for f, e in zip(library, explicit):
        np.testing.assert_allclose(f, e, rtol=1e-5, atol=1e-6)


def test_fused_path_is_the_explicit_one_on_cpu_and_the_library_kernel_elsewhere(monkeypatch):
    q, k, v = random_qkv(seed=8)
    mask = random_mask(seed=8)
    explicit, _ = attention.scaled_dot_product_attention(q, k, v, mask)
    library, calls = attention.library_scaled_dot_product_attention, []
    monkeypatch.setattr(
        attention, "library_scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or library(*a, **kw)
    )
    np.testing.assert_array_equal(attention.fused_scaled_dot_product_attention(q, k, v, mask), explicit)
    assert not calls
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    np.testing.assert_allclose(
        attention.fused_scaled_dot_product_attention(q, k, v, mask), explicit, rtol=1e-5, atol=1e-6
    )
    assert calls == [1]


def test_library_path_accepts_broadcast_masks():
    q, k, v = random_qkv(seed=6, t=4, s=4)
    causal = attention.causal_mask(4)  # [1, 1, T, T]
    explicit, _ = attention.scaled_dot_product_attention(q, k, v, causal)
    np.testing.assert_allclose(
        attention.library_scaled_dot_product_attention(q, k, v, causal), explicit, rtol=1e-5, atol=1e-6
    )


def test_gradients_match_finite_differences():
    with jax.enable_x64(True):
        q, k, v = (x.astype(np.float64) for x in random_qkv(seed=7, b=1, t=3, s=4, n=2, h=3))
        mask = np.ones((1, 2, 3, 4), bool)
        mask[0, 0, 1, 2:] = False
        w = np.random.default_rng(8).normal(size=(2, 3, 3))
        vv = np.random.default_rng(9).normal(size=(2, 3))
        check_grads(
            jax.jit(lambda q, k, v: attention.scaled_dot_product_attention(q, k, v, mask)[0]), (q, k, v), order=2
        )
        check_grads(jax.jit(attention.dot_scores), (q, k), order=2)
        check_grads(jax.jit(attention.general_scores), (q, k, w), order=2)
        check_grads(
            jax.jit(lambda q, k, v: attention.additive_scores(q, k, v, query_chunk_size=2)), (q, k, vv), order=2
        )


def test_rank_errors_name_the_argument():
    q, k, _ = random_qkv()
    with pytest.raises(ValueError, match="key must have rank 4"):
        attention.dot_scores(q, k[0])


# ---------------------------------------------------------- multi-head module


def np_multi_head(module: MultiHeadAttention, x_q, x_kv, mask):
    """Per-head loop with per-head slices of the projection kernels, then the output projection."""
    get = lambda layer, name: np.float64(getattr(layer, name)[...])
    n, h = module.num_heads, module.head_dim
    heads = []
    for head in range(n):
        cols = slice(head * h, (head + 1) * h)
        q = x_q @ get(module.query, "kernel")[:, cols] + get(module.query, "bias")[cols]  # [B, T, H]
        # no key bias
        k = x_kv @ get(module.key, "kernel")[:, cols]
        v = x_kv @ get(module.value, "kernel")[:, cols] + get(module.value, "bias")[cols]
        if module.score == "scaled_dot":
            scores = q @ k.transpose(0, 2, 1) / np.sqrt(h)
        elif module.score == "dot":
            scores = q @ k.transpose(0, 2, 1)
        elif module.score == "general":
            scores = q @ np.float64(module.score_weight[...][head]) @ k.transpose(0, 2, 1)
        else:
            vec = np.float64(module.score_weight[...][head])
            scores = np.tanh(q[:, :, None, :] + k[:, None, :, :]) @ vec
        weights = np_masked_softmax(scores, None if mask is None else mask[:, 0])
        heads.append(weights @ v)  # [B, T, H]
    concat = np.concatenate(heads, axis=-1)
    return concat @ get(module.out, "kernel") + get(module.out, "bias")


@pytest.mark.parametrize("score", attention.SCORES)
def test_multi_head_equals_concatenated_single_heads(score):
    rng = np.random.default_rng(10)
    x_q = rng.normal(size=(2, 5, 12)).astype(np.float32)
    x_kv = rng.normal(size=(2, 6, 8)).astype(np.float32)
    mask = rng.random((2, 1, 5, 6)) > 0.3
    mask[..., 0] = True
    module = MultiHeadAttention(3, 12, kv_features=8, score=score, additive_chunk_size=2, rngs=nnx.Rngs(0))
    out = module(x_q, x_kv, mask)
    np.testing.assert_allclose(
        out, np_multi_head(module, np.float64(x_q), np.float64(x_kv), mask), rtol=1e-5, atol=1e-5
    )


def test_capture_returns_weights_and_plain_call_keeps_no_state():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, 4, 8)).astype(np.float32)
    mask = attention.causal_mask(4)
    module = MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))
    # fused path (the explicit one on CPU)
    plain = module(x, mask=mask)
    assert len(nnx.state(module, nnx.Intermediate)) == 0
    # explicit path
    captured, recorded = nnx.capture(module, AttentionWeights)(x, mask=mask)
    np.testing.assert_allclose(captured, plain, rtol=1e-5, atol=1e-6)
    (weights,) = recorded["attention_weights"].get_value()
    assert weights.shape == (2, 2, 4, 4)
    k, _ = module.project_key_value(x)
    q = module._split_heads(module.query(x))
    np.testing.assert_allclose(weights, np_masked_softmax(np_dot_scores(q, k) / 2.0, mask), rtol=1e-5, atol=1e-6)
    assert len(nnx.state(module, nnx.Intermediate)) == 0


def test_attention_dropout_only_in_training():
    x = np.random.default_rng(12).normal(size=(2, 4, 8)).astype(np.float32)
    module = MultiHeadAttention(2, 8, dropout_rate=0.5, rngs=nnx.Rngs(0))
    eval_out = module(x, deterministic=True)
    np.testing.assert_array_equal(eval_out, module(x, deterministic=True))
    train_out = module(x, deterministic=False)
    assert not np.allclose(train_out, eval_out)


@pytest.mark.parametrize("score", attention.SCORES)
def test_cached_decoding_equals_causal_self_attention(score):
    x = np.random.default_rng(13).normal(size=(2, 5, 8)).astype(np.float32)
    module = MultiHeadAttention(2, 8, score=score, rngs=nnx.Rngs(1))
    full = module(x, mask=attention.causal_mask(5))
    cache = module.init_cache(2, 7)
    steps = []
    for t in range(5):
        out, cache = module.decode(x[:, t : t + 1], cache)
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)
    assert int(cache.index) == 5


@pytest.mark.parametrize("score", ["scaled_dot", "general"])
def test_cached_hypotheses_attend_to_their_own_prefixes_when_reordered(score, monkeypatch):
    """Two sources with three hypotheses each, reordered after every step as a beam search would
    (slots stay, `origins` follows), over three prefix chunks (the switch between prefix lengths):
    every step's output is causal self-attention over that row's own history."""
    monkeypatch.setattr(attention, "PREFIX_CHUNK", 4)
    steps, groups, hypotheses = 11, 2, 3
    rows = groups * hypotheses
    rng = np.random.default_rng(14)
    module = MultiHeadAttention(2, 8, score=score, rngs=nnx.Rngs(2))
    step = jax.jit(lambda x, cache: module.decode(x, cache))
    # causal: position t of the whole padded sequence sees only the history up to t
    teacher_forced = jax.jit(lambda histories: module(histories, mask=attention.causal_mask(steps)))
    cache = module.init_cache(rows, steps, hypotheses=hypotheses)
    histories = np.zeros((rows, steps, 8), np.float32)
    for t in range(steps):
        histories[:, t] = rng.normal(size=(rows, 8))
        out, cache = step(histories[:, t : t + 1], cache)
        np.testing.assert_allclose(out[:, 0], teacher_forced(histories)[:, t], rtol=1e-5, atol=1e-5)
        origins = rng.integers(0, hypotheses, size=(groups, hypotheses))
        cache = cache.reorder_hypotheses(jnp.asarray(origins))
        histories = histories[np.asarray(attention.hypothesis_rows(jnp.asarray(origins)))]


def test_unknown_score_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown attention score 'cosine'.*scaled_dot"):
        MultiHeadAttention(2, 8, score="cosine", rngs=nnx.Rngs(0))


# -------------------------------------------------------- single-head module


@pytest.mark.parametrize("score", ["additive", "concat", "general", "dot"])
def test_single_head_attention_matches_numpy_and_ignores_padding(score):
    rng = np.random.default_rng(14)
    query_dim = 6
    key_dim = 6 if score == "dot" else 10
    query = rng.normal(size=(2, query_dim)).astype(np.float32)
    keys = rng.normal(size=(2, 5, key_dim)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    module = Attention(query_dim, key_dim, score=score, attention_dim=7, rngs=nnx.Rngs(0))
    context, weights = module(query, module.project_keys(keys), keys, mask)

    q64, k64 = np.float64(query), np.float64(keys)
    # e_j = v^T tanh(W q + U h_j)   (Bahdanau appendix A.1.2)
    if score in ("additive", "concat"):
        wq = q64 @ np.float64(module.query_proj.kernel[...])
        uh = k64 @ np.float64(module.key_proj.kernel[...]) + np.float64(module.key_proj.bias[...])
        scores = np.tanh(wq[:, None, :] + uh) @ np.float64(module.v[...])
    elif score == "general":
        # e_j = q^T W_a h_j
        scores = np.einsum("bq,bsq->bs", q64, k64 @ np.float64(module.key_proj.kernel[...]))
    else:
        scores = np.einsum("bq,bsq->bs", q64, k64)
    ref_weights = np_masked_softmax(scores, mask)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(context, np.einsum("bs,bsd->bd", ref_weights, k64), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(weights)[1, 3:] == 0.0)


def test_single_head_attention_records_a_pass_only_when_captured():
    module = Attention(4, 4, rngs=nnx.Rngs(0))
    weights = np.random.default_rng(15).random((2, 3, 5)).astype(np.float32)  # [B, T, S]
    _, recorded = nnx.capture(module.record, AttentionWeights)(weights)
    np.testing.assert_array_equal(recorded["attention_weights"].get_value()[0], weights[:, None])
    # outside a capture: nothing is kept on the module
    module.record(weights)
    assert not nnx.state(module, AttentionWeights)
