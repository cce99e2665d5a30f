"""models/layers.py: embeddings, positional encodings, feed-forward and shift_right against the paper's
formulas; the packed dropout masks against Bernoulli statistics and nnx.Dropout; LayerNorm's fast
variance (issue 27), where it loses precision, and that this model stays clear of it.

`models.layers.layer_norm` is `nnx.LayerNorm` with flax's default `use_fast_variance=True`: the
variance is `E[x^2] - E[x]^2`, two float32 means of size `mean^2` whose difference is the much
smaller `std^2` when `|mean| / std` (r below) is large. Its error grows like r^2: about
6e-7 r^2 on a unit-variance output, float32's own rounding at r = 1, 5e-3 at r = 100, and at
r = 1e4 the variance is gone. The two-pass `E[(x - E[x])^2]` has no such term.

The first test shows the damage is real; the others measure r at the input of every LayerNorm of
the tests' trained Transformer (`finished_run`, the dates task), at initialisation and after
training, in float32 and bfloat16, on real dates, and find the outputs equal to a float64
two-pass reference up to the dtype's rounding. So the fast variance stays: switching to the
two-pass one would change the default run's bits (`make train`) for nothing.

Measured (r: the largest over the rows of a batch of 32 real dates, over the LayerNorms):
  - the tiny run here (d_model 16, 1+1 layers): r <= 0.96 at initialisation, <= 1.00 after its 20
    steps; float32 error against float64 <= 7e-7; bfloat16 error <= 0.017 at |y| about 4 (the
    output's and the scale's rounding), fast and two-pass in bfloat16 equal but for one element
    one bfloat16 step apart.
  - configs/default.py's model (d_model 128, 2+2 layers, by hand, not here): r <= 0.50 at
    initialisation, <= 0.59 after 600 steps, <= 1.14 after the full 2000 steps (exact match 1.0);
    float32 error <= 8e-7; its inputs cast to bfloat16: error <= 0.005 (|y| + 1), fast and
    two-pass at most one bfloat16 step apart.
  - the fast variance's float32 error on mean-r, std-1 rows (width 16..512): about 6e-7 r^2:
    1e-6 at r = 1, 6e-6 at 3, 6e-5 at 10, 5e-3 at 100, 0.2 .. 1.2 at 1e3 (the first test), 4e3 at
    1e4; the two-pass variance's: <= 2e-4 up to r = 1e3.
Post-LN inputs are `x + Sublayer(x)` with `x` a LayerNorm output or embedding + positions, rows of
mean about 0 against a spread about 1, hence r of order 1. In bfloat16 the fast variance matters
even less: a bfloat16 input is itself rounded by 2^-9 |x| ~ 2^-9 r std, which outweighs the
variance's 6e-7 r^2 up to r ~ 3e3.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from helpers.references import np_layer_norm
from models import layers
from models.layers import Embed, FeedForward, layer_norm, shift_right, sinusoidal_encoding
from run_setup.input_kinds import padded_ids
from run_setup.run import model_fields, prepare_run
from run_setup.settings import read_run_settings, single_process
from tasks import dates
from tasks.vocabularies import EOS_ID
from utils.errors import ConfigError


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


# ---------------------------------------------------------------- LayerNorm's fast variance

# Up to this |mean| / std the fast variance's own float32 error, about 6e-7 r^2, stays within the
# float32 tolerance below (1e-5); the model's LayerNorm inputs measure about 1.
SAFE_RATIO = 3.0


@nnx.jit
def apply(norm, x):
    """One compilation per shape: op-by-op dispatch compiles each of LayerNorm's operations."""
    return norm(x)


def shifted_rows(mean: float, width: int) -> np.ndarray:
    """float32 `[64, width]`: `mean` + standard normal noise, so |mean| / std is about `mean`."""
    return (mean + np.random.default_rng(0).normal(size=(64, width))).astype(np.float32)


@pytest.mark.parametrize("width", [16, 128, 512])
def test_the_fast_variance_loses_precision_when_the_mean_is_large_against_the_spread(width):
    """The weakness of issue 27 is real: at |mean| / std = 1e3 the float32 output is off by tenths of
    a unit-variance output, where the two-pass variance in the same float32 is off by 2e-4."""
    x = shifted_rows(1e3, width)
    expected = np_layer_norm(x, 1.0, 0.0)
    # the project's: use_fast_variance=True
    fast = layer_norm(width, rngs=nnx.Rngs(0))
    two_pass = nnx.LayerNorm(width, epsilon=1e-6, use_fast_variance=False, rngs=nnx.Rngs(0))
    assert np.abs(np.asarray(apply(fast, x)) - expected).max() > 0.1
    np.testing.assert_allclose(apply(two_pass, x), expected, atol=1e-3)


def layer_norm_calls(model: nnx.Module, batch: dict) -> list[tuple[np.ndarray, ...]]:
    """`(input [..., D], scale [D], bias [D], output [..., D])` of every LayerNorm call in one forward
    pass of `model`, as NumPy, in call order. Jitted: eager dispatch of a whole model is slow."""
    original = nnx.LayerNorm.__call__

    def recording(self, x, **kwargs):
        y = original(self, x, **kwargs)
        calls.append((x, self.scale[...], self.bias[...], y))
        return y

    @nnx.jit
    def forward(model, batch):
        model(batch)
        return list(calls)

    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nnx.LayerNorm, "__call__", recording)
        traced = forward(model, batch)
    return [tuple(np.asarray(a) for a in call) for call in traced]


def mean_over_spread(x: np.ndarray) -> float:
    """The largest |mean| / std over the rows of `x [..., D]`."""
    x = np.asarray(x, np.float64)
    return float(np.max(np.abs(x.mean(-1)) / x.std(-1)))


def normalised(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, *, fast: bool = True) -> np.ndarray:
    """`x [..., D]` through the project's LayerNorm (`fast`) or flax's two-pass one, in `x`'s dtype,
    with the given parameters: float64 `[..., D]`."""
    norm = layer_norm(scale.shape[-1], dtype=x.dtype, rngs=nnx.Rngs(0))
    norm.use_fast_variance = fast
    norm.scale[...], norm.bias[...] = scale, bias
    return np.float64(apply(norm, x))


def check_layer_norms(calls, dtype) -> float:
    """Each call's input normalised by the project's LayerNorm (fast variance) against the float64
    two-pass reference on the same input, to the dtype's rounding; in float32 the output the model
    computed too, in bfloat16 flax's two-pass LayerNorm too. Returns the largest |mean| / std.

    Why the output is recomputed in bfloat16: in the jitted model XLA may keep the bfloat16 sum
    `x + Sublayer(x)` in float32 (`xla_allow_excess_precision`), so the model's output differs from
    the captured input's by that input's rounding (up to 0.02 here), which is no matter of the
    variance: under `--xla_allow_excess_precision=false` the model's own outputs are as close as the
    recomputed ones."""
    assert calls, "no LayerNorm was called"
    for x, scale, bias, y in calls:
        assert x.dtype == y.dtype == dtype
        expected = np_layer_norm(x, scale, bias)
        fast = normalised(x, scale, bias)
        if dtype == jnp.float32:
            np.testing.assert_allclose(fast, expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
        else:
            # One rounding of the output to bfloat16 (2^-9 relative) and one of the scale, which
            # nnx.LayerNorm casts to the compute dtype: 2^-8 in all; twice that as the tolerance.
            np.testing.assert_allclose(fast, expected, rtol=2**-7, atol=1e-3)
            np.testing.assert_allclose(fast, normalised(x, scale, bias, fast=False), rtol=2**-7, atol=1e-3)
    return max(mean_over_spread(x) for x, *_ in calls)


def dates_batch(run, count: int = 32) -> dict:
    """`count` fresh dates of the run's task, as the model reads them: `inputs [B, S]`, `targets [B, T]`."""
    rng = np.random.default_rng(1)
    examples = [dates.draw_example(rng, tuple(run.settings.task.params["languages"])) for _ in range(count)]
    source = [np.append(run.tokens.source.encode(e["source"]), EOS_ID) for e in examples]
    target = [np.append(run.tokens.target.encode(e["target"]), EOS_ID) for e in examples]
    return {"inputs": jnp.asarray(padded_ids(source, count, 0)), "targets": jnp.asarray(padded_ids(target, count, 0))}


@pytest.fixture(scope="module")
def run_and_params(finished_run):
    """The tiny trained run (its settings, vocabulary, model), its initial and its trained parameters."""
    _, workdir, _ = finished_run
    run = prepare_run(single_process(read_run_settings(workdir)), workdir, with_data=False, training=False)
    _, trained = run.restore_params()
    run.checkpoints.close()
    return run, {"initial": run.params, "trained": trained}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("when", ["initial", "trained"])
def test_the_models_layer_norm_inputs_are_far_from_the_damage(run_and_params, when, dtype):
    """On real dates the model's LayerNorm inputs have |mean| / std of order 1, where the fast
    variance's output equals the float64 two-pass one to the dtype's rounding."""
    run, params = run_and_params
    fields = {**model_fields(run.settings, run.tokens), "dtype": jnp.dtype(dtype).name}
    model = models.create_model(run.settings.model.name, rngs=nnx.Rngs(0), **fields)
    nnx.update(model, params[when])
    ratio = check_layer_norms(layer_norm_calls(model, dates_batch(run)), dtype)
    assert ratio < SAFE_RATIO, f"|mean| / std reaches {ratio:.3g} at a LayerNorm input"


def test_the_check_fails_where_the_mean_is_large():
    """`check_layer_norms` is not blind: the first test's input fails it, in float32 and bfloat16."""
    for dtype in (jnp.float32, jnp.bfloat16):
        norm = layer_norm(128, dtype=dtype, rngs=nnx.Rngs(0))
        x = jnp.asarray(shifted_rows(1e3, 128), dtype)
        with pytest.raises(AssertionError, match="Not equal to tolerance"):
            check_layer_norms(
                [(np.asarray(x), np.asarray(norm.scale[...]), np.asarray(norm.bias[...]), np.asarray(apply(norm, x)))],
                dtype,
            )


# ----------------------------------------------------------------------------- dropout masks


def test_packed_keep_mask_keeps_the_rounded_share_independently_of_position():
    """Bernoulli(p) entries, p = round(0.9 * 2^16) / 2^16: the kept share of 2^20 entries within 5
    binomial standard deviations of p, and so is each of the four 16-bit lanes of a block and each
    row; entries 1, 2 and 4 apart (the same block's words and halves, the next block) are both kept
    as often as independent draws are (a word or a counter used twice would show here)."""
    mask, keep = layers.packed_keep_mask(jax.random.key(7), 0.9, (256, 4096))
    assert keep == round(0.9 * 2**16) / 2**16 == 58982 / 65536
    mask = np.asarray(mask)
    assert mask.shape == (256, 4096) and mask.dtype == bool

    def close(share: float, count: int) -> bool:
        return abs(share - keep) < 5 * np.sqrt(keep * (1 - keep) / count)

    assert close(mask.mean(), mask.size)
    lanes = mask.reshape(256, 1024, 4)
    assert all(close(lanes[..., lane].mean(), lanes[..., lane].size) for lane in range(4))
    assert np.mean([close(row.mean(), row.size) for row in mask]) > 0.99
    both_kept = keep * keep
    for shift in (1, 2, 4):
        agree = (mask[:, shift:] & mask[:, :-shift]).mean()
        assert abs(agree - both_kept) < 5 * np.sqrt(both_kept * (1 - both_kept) / mask[:, shift:].size)


def test_packed_keep_mask_is_the_keys_own():
    """The same key draws the same mask; another key (the next step's) another; a width that is
    not a multiple of four is the first entries of the next multiple's mask; blocks are counted
    over the whole array (rows do not reuse counters); an unknown kind of mask is refused."""
    key = jax.random.key(3)
    first, _ = layers.packed_keep_mask(key, 0.5, (8, 16))
    np.testing.assert_array_equal(first, layers.packed_keep_mask(key, 0.5, (8, 16))[0])
    assert not np.array_equal(first, layers.packed_keep_mask(jax.random.fold_in(key, 1), 0.5, (8, 16))[0])
    # a row of 6 is the first 6 of the row of 8: the same two blocks, in every row
    np.testing.assert_array_equal(
        layers.packed_keep_mask(key, 0.5, (2, 3, 6))[0], layers.packed_keep_mask(key, 0.5, (2, 3, 8))[0][..., :6]
    )
    # each block's counter is its place in the whole grid: rows of 8 are the flat mask's pieces
    np.testing.assert_array_equal(
        layers.packed_keep_mask(key, 0.5, (5, 8))[0], layers.packed_keep_mask(key, 0.5, (40,))[0].reshape(5, 8)
    )
    # the smallest keep probability, 2^-16: an entry is kept when its draw is 0 alone (a `<=` would
    # keep 1 as well and double the count): 128 expected in 2^23 entries, 11 their standard deviation
    kept = int(layers.packed_keep_mask(key, 2**-16, (2048, 4096))[0].sum())
    assert abs(kept - 128) < 5 * np.sqrt(128), kept
    with pytest.raises(ValueError, match="dropout masks must be one of packed, bernoulli, got 'mask'"):
        layers.Dropout(0.1, masks="mask", rngs=nnx.Rngs(0))


def test_packed_dropout_keeps_the_expectation_and_the_stream():
    """Kept entries are divided by the rounded keep probability, so the mean of many dropped-out
    ones is 1; the module draws from its `dropout` stream as `nnx.Dropout` does (reseeding replays
    it); "bernoulli" is `nnx.Dropout` bit for bit; deterministic or rate 0 is the identity."""
    ones = jnp.ones((512, 1024))
    packed = layers.Dropout(0.1, rngs=nnx.Rngs(dropout=5))
    dropped = np.asarray(packed(ones, deterministic=False))
    assert set(np.unique(dropped)) == {0.0, np.float32(65536 / 58982)}
    assert abs(dropped.mean() - 1.0) < 5 * np.sqrt(0.1 / 0.9 / dropped.size)
    nnx.reseed(packed, dropout=5)
    np.testing.assert_array_equal(packed(ones, deterministic=False), dropped)
    assert not np.array_equal(packed(ones, deterministic=False), dropped)

    bernoulli = layers.Dropout(0.1, masks="bernoulli", rngs=nnx.Rngs(dropout=5))
    np.testing.assert_array_equal(
        bernoulli(ones, deterministic=False), nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=5))(ones, deterministic=False)
    )
    np.testing.assert_array_equal(packed(ones, deterministic=True), ones)
    np.testing.assert_array_equal(layers.Dropout(0.0, rngs=nnx.Rngs(dropout=5))(ones, deterministic=False), ones)


def test_dropout_masks_is_checked_by_every_family():
    """An unknown value names the field and the valid ones; a run folder written before the field
    existed reads back as "bernoulli", the masks it trained with."""
    for family in models.MODELS:
        with pytest.raises(ConfigError, match="model.dropout_masks must be one of packed, bernoulli, got 'mask'"):
            models.checked_config(family, dropout_masks="mask")
        assert models.fields_before(family)["dropout_masks"] == "bernoulli"
