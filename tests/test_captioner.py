"""Show, Attend and Tell (Xu et al. 2015) against float64 NumPy written from its equations: the
decoder's steps, hard attention's objective with every term on (each draw's loss, gradient and
baseline, enumerated over every location sequence of a 2 x 2 grid), its gradient estimator against
the exact gradient of L_s, and the doubly stochastic penalty."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from helpers.references import np_log_softmax, np_numerical_gradient, np_softmax
from models.captioner import doubly_stochastic_penalty
from scoring import metrics
from utils.errors import ConfigError

V, E, N, A, D, L = 11, 5, 6, 4, 3, 5
BOS, PAD = 1, 0


def make(**fields):
    """A feature-grid captioner of tiny sizes, with the gating scalar beta on (so that the references
    cover eq. 6's gate; the configs train without it)."""
    sizes = dict(
        vocab_size=V, embed_dim=E, hidden_dim=N, attention_dim=A, inputs="features", feature_dim=D, selector=True
    )
    return models.create_model("captioner", rngs=nnx.Rngs(params=0, dropout=1), **{**sizes, **fields})


def f64(x):
    return np.asarray(x[...] if hasattr(x, "get_value") else x, np.float64)


def weights_of(tree) -> dict[str, np.ndarray]:
    """A model's parameters, or a gradient's state, as float64 arrays by dotted name (`attention.v`,
    `lstm.input_proj.kernel`, ...): what the references read and perturb."""
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree, nnx.Param)
    return {".".join(map(str, path)): f64(leaf) for path, leaf in nnx.to_flat_state(state)}


# -- the NumPy reference, from the paper's equations ----------------------------------------------


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def affine(w, name, x):
    out = x @ w[f"{name}.kernel"]
    return out + w[f"{name}.bias"] if f"{name}.bias" in w else out


def reference_start(w, annotations):
    """h_0, c_0 = tanh(f_init(mean_i a_i)) (section 3.1.2)."""
    mean = annotations.mean(axis=1)
    return np.tanh(affine(w, "init_hidden", mean)), np.tanh(affine(w, "init_cell", mean))


def reference_step(w, annotations, word, hidden, cell, location=None):
    """One decoder step of section 3.1.2 in float64 from the weights `w`: `(logits, h_t, c_t, alpha_t)`.
    Soft attention's context z = beta sum_i alpha_i a_i, or hard attention's z = beta a_s at a fixed
    `location` s (eq. 9)."""
    scores = (
        np.tanh(affine(w, "attention.key_proj", annotations) + (hidden @ w["attention.query_proj.kernel"])[:, None])
        @ w["attention.v"]
    )
    # eqs. 4-5
    alpha = np_softmax(scores)
    # section 4.2.1
    beta = sigmoid(affine(w, "beta", hidden)) if "beta.kernel" in w else 1.0
    if location is None:
        z = beta * np.einsum("bl,bld->bd", alpha, annotations)
    else:
        z = beta * annotations[np.arange(len(location)), location]
    embedded = w["embed.embedding"][word]
    gates = affine(w, "lstm.input_proj", np.concatenate([embedded, z], -1)) + hidden @ w["lstm.hidden_proj.kernel"]
    # eq. 1
    i, f, o, g = np.split(gates, 4, -1)
    # eq. 2
    cell = sigmoid(f) * cell + sigmoid(i) * np.tanh(g)
    # eq. 3
    hidden = sigmoid(o) * np.tanh(cell)
    deep = embedded + affine(w, "output_hidden", hidden) + affine(w, "output_context", z)
    # eq. 7
    return affine(w, "output", deep), hidden, cell, alpha


def caption_terms(w, annotations, targets, locations=None):
    """A teacher-forced pass over `targets [B, T]`, and per caption `[B]`, over its real (not padding)
    steps: `log_likelihood` log p(y | s, a) (with the expected context where `locations` is None),
    `log_locations` log p(s | a) = sum_t log alpha_{t, s_t} (eq. 8), `entropy` H[s] = sum_t H[alpha_t]
    (section 4.1's entropy term) and `penalty` sum_i (1 - sum_t alpha_ti)^2 (section 4.2.1)."""
    hidden, cell = reference_start(w, annotations)
    rows, previous = np.arange(len(targets)), np.full(len(targets), BOS)
    log_likelihood, alphas = [], []
    for t in range(targets.shape[1]):
        logits, hidden, cell, alpha = reference_step(
            w, annotations, previous, hidden, cell, None if locations is None else locations[:, t]
        )
        log_likelihood.append(np_log_softmax(logits)[rows, targets[:, t]])
        alphas.append(alpha)
        previous = targets[:, t]
    real = targets != PAD  # [B, T]
    alpha = np.stack(alphas, 1)  # [B, T, L]
    terms = {
        "log_likelihood": np.sum(np.stack(log_likelihood, 1) * real, 1),
        "entropy": np.sum(-np.sum(alpha * np.log(alpha), -1) * real, 1),
        "penalty": np.sum((1.0 - np.sum(alpha * real[..., None], 1)) ** 2, -1),
    }
    if locations is not None:
        terms["log_locations"] = np.sum(np.log(np.take_along_axis(alpha, locations[..., None], -1)[..., 0]) * real, 1)
    return terms


def location_sequences(cells, real_steps, steps):
    """Every location sequence over a caption's real steps, `[cells^real_steps, steps]` (padding steps
    at location 0: nothing reads them)."""
    sequences = np.array(list(itertools.product(range(cells), repeat=real_steps)), int).reshape(-1, real_steps)
    return np.pad(sequences, ((0, 0), (0, steps - real_steps)))


# -- the decoder's steps against the reference ----------------------------------------------------


def test_soft_decoder_steps_are_the_papers_equations():
    model = make()
    weights = weights_of(model)
    annotations = np.random.default_rng(0).normal(size=(2, L, D))
    memory = model.encode(jnp.float32(annotations))
    state = model.init_decode_state(memory, 2, 4)
    hidden, cell = reference_start(weights, annotations)
    np.testing.assert_allclose(state.lstm.hidden, hidden, rtol=1e-5, atol=1e-6)
    for word in ([1, 1], [4, 7], [9, 2]):
        logits, state = model.decode_step(memory, jnp.asarray(word), state)
        expected, hidden, cell, _ = reference_step(weights, annotations, np.asarray(word), hidden, cell)
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state.lstm.cell, cell, rtol=1e-4, atol=1e-5)


def test_hard_attention_pass_reads_the_sampled_locations():
    """A teacher-forced hard-attention pass at fixed locations equals the reference with z = beta a_s,
    and its sampled locations follow alpha (the most likely location wins most often)."""
    model = make(attention="hard")
    weights = weights_of(model)
    rng = np.random.default_rng(1)
    annotations = rng.normal(size=(2, L, D))
    targets = np.array([[3, 5, 2], [4, 2, 0]])
    locations = np.array([[0, 4, 2], [3, 3, 1]])
    batch = {"inputs": jnp.float32(annotations), "targets": jnp.asarray(targets)}
    out = model.teacher_forced(batch, locations=jnp.asarray(locations))
    hidden, cell = reference_start(weights, annotations)
    previous = np.ones(2, int)
    for t in range(3):
        expected, hidden, cell, alpha = reference_step(weights, annotations, previous, hidden, cell, locations[:, t])
        np.testing.assert_allclose(out["logits"][:, t], expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out["weights"][:, t], alpha, rtol=1e-4, atol=1e-6)
        previous = targets[:, t]
    draws = jax.jit(jax.vmap(lambda key: model.teacher_forced(batch, key=key)["locations"][:, 0]))(
        jax.random.split(jax.random.key(0), 2000)
    )
    frequencies = np.stack([np.bincount(np.asarray(draws[:, row]), minlength=L) / 2000 for row in range(2)])
    # s_1 ~ alpha_1 (eq. 8)
    np.testing.assert_allclose(frequencies, out["weights"][:, 0], atol=0.04)


# -- hard attention's objective with every term on, draw by draw -----------------------------------


def rule_terms(w, annotations, targets, expectation, locations, rewards, rule):
    """Section 4.1's final learning rule for one draw, per caption `[B]`: its `loss` (whose gradient
    descends the rule), and the `log_likelihood`, `penalty` and `log_locations` of the pass it made.
    On the expected context (`expectation [B]`, with probability 0.5 per image) the soft loss
    -log p(y | a) + lambda sum_i (1 - sum_t alpha_ti)^2; otherwise, at the sampled `locations [B, T]`,

        -log p(y | s, a) + lambda (penalty) - lambda_r [log p(y | s, a) - b] log p(s | a) - lambda_e H[s]

    with `rewards [B]` = log p(y | s, a) - b held constant (its gradient is eq. 12's estimate)."""
    soft = caption_terms(w, annotations, targets)
    hard = caption_terms(w, annotations, targets, locations)
    made = {name: np.where(expectation, soft[name], hard[name]) for name in ("log_likelihood", "penalty")}
    surrogate = rule["reinforce_weight"] * rewards * hard["log_locations"] + rule["entropy_weight"] * hard["entropy"]
    loss = -made["log_likelihood"] + rule["doubly_stochastic"] * made["penalty"] - np.where(expectation, 0.0, surrogate)
    return {**made, "loss": loss, "log_locations": hard["log_locations"]}


# a 2 x 2 annotation grid: 4^3 location sequences for a 3-word caption
GRID = 4
# the decay (0.9) and the 0.5: the defaults
RULE = dict(doubly_stochastic=0.5, reinforce_weight=0.3, entropy_weight=0.2)
# b before the step (away from log p(y | s, a), so the reward is not 0)
BASELINE = -4.0
KEYS = 200


def draw_table(w, annotations, targets, rule, baseline):
    """Every draw the objective can make for each caption, in float64: the expected context (first),
    then each location sequence over the caption's real steps; per caption, a dict of `[draws]` arrays
    (`expectation`, `locations`, `rewards`, `probability` and `rule_terms`' values)."""
    table = []
    for row in range(len(targets)):
        sequences = location_sequences(GRID, int(np.sum(targets[row] != PAD)), targets.shape[1])
        expectation = np.arange(len(sequences) + 1) == 0
        locations = np.concatenate([sequences[:1] * 0, sequences])
        image, caption = (
            np.repeat(annotations[row : row + 1], len(locations), 0),
            np.repeat(targets[row : row + 1], len(locations), 0),
        )
        rewards = caption_terms(w, image, caption, locations)["log_likelihood"] - baseline
        terms = rule_terms(w, image, caption, expectation, locations, rewards, rule)
        probability = np.where(expectation, 0.5, 0.5 * np.exp(terms["log_locations"]))
        # the table holds every draw
        np.testing.assert_allclose(probability.sum(), 1.0, rtol=1e-12)
        table.append(
            {
                **terms,
                "expectation": expectation,
                "locations": locations,
                "rewards": rewards,
                "probability": probability,
            }
        )
    return table


def identify_draws(table, nll_sums, penalty_sums, tolerance=1e-4):
    """Per key, the draw `[B]` (an index into each caption's table) whose likelihood and penalty sums
    the objective reported: every draw of the batch is enumerated, and no two have both sums within
    `tolerance`; fails where no draw fits, or several do."""
    likelihood = functools.reduce(np.add.outer, [row["log_likelihood"] for row in table])  # [draws_1, ..., draws_B]
    penalty = functools.reduce(np.add.outer, [row["penalty"] for row in table])
    draws = []
    for key, (nll, penalty_sum) in enumerate(zip(nll_sums, penalty_sums)):
        fits = np.argwhere((np.abs(-likelihood - nll) < tolerance) & (np.abs(penalty - penalty_sum) < tolerance))
        assert len(fits) == 1, (
            f"key {key}: {len(fits)} draws have the objective's NLL {nll:.6f} and penalty {penalty_sum:.6f}"
        )
        draws.append(tuple(fits[0]))
    return draws


def chosen(table, draw, name):
    """`name` of the captions' draws: `[B, ...]`."""
    return np.stack([row[name][index] for row, index in zip(table, draw)])


@pytest.fixture(scope="module")
def objective_draws():
    """`Captioner.objective` with every term on (the penalty, lambda_r, lambda_e, the expectation trick
    at 0.5 and the baseline), on two captions of a 2 x 2 grid, the second with a padding step: per key,
    its loss, NLL and penalty sums, next baseline and gradient; beside NumPy's table of every draw."""
    model = make(attention="hard", vocab_size=6, embed_dim=3, hidden_dim=3, attention_dim=3, **RULE)
    annotations = np.random.default_rng(7).normal(size=(2, GRID, D))
    targets = np.array([[3, 4, 2], [5, 2, PAD]])
    batch = {"inputs": jnp.float32(annotations), "targets": jnp.asarray(targets)}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def objective(params, key):
        model = nnx.merge(graphdef, params, rest)
        loss, sums, state = model.objective(batch, {"baseline": jnp.float32(BASELINE)}, key, metrics.token_sums)
        return loss, {"nll": sums["nll_sum"], "penalty": sums["doubly_stochastic_sum"], "baseline": state["baseline"]}

    run = jax.jit(jax.vmap(jax.value_and_grad(objective, has_aux=True), in_axes=(None, 0)))
    (loss, outputs), grads = run(params, jax.random.split(jax.random.key(8), KEYS))
    weights = weights_of(model)
    return {
        "annotations": annotations,
        "targets": targets,
        "weights": weights,
        "loss": np.asarray(loss, np.float64),
        **{name: np.asarray(value, np.float64) for name, value in outputs.items()},
        "grads": weights_of(grads),
        "table": draw_table(weights, annotations, targets, RULE, BASELINE),
    }


def test_objective_is_the_rule_for_every_draw(objective_draws):
    """Each key's loss is section 4.1's rule (NumPy, every term on) for the draw it made: a sign
    flipped in any term, the expectation switch reversed or a padding step counted fails it."""
    run, table = objective_draws, objective_draws["table"]
    draws = identify_draws(table, run["nll"], run["penalty"])
    want = np.array([chosen(table, draw, "loss").sum() for draw in draws])
    np.testing.assert_allclose(run["loss"], want, rtol=1e-5, atol=1e-4)


def test_baseline_moves_as_the_paper_says(objective_draws):
    """b <- 0.9 b + 0.1 log p(y | s, a), averaged over the batch's captions (those on the expected
    context with their log p(y | a), `Captioner.objective` says why)."""
    run, table = objective_draws, objective_draws["table"]
    draws = identify_draws(table, run["nll"], run["penalty"])
    want = np.array([0.9 * BASELINE + 0.1 * chosen(table, draw, "log_likelihood").mean() for draw in draws])
    np.testing.assert_allclose(run["baseline"], want, rtol=1e-5, atol=1e-5)


def test_expected_context_is_drawn_per_image_with_probability_one_half(objective_draws):
    """Section 4.1's trick: each image, independently, on the expected context with probability 0.5."""
    run, table = objective_draws, objective_draws["table"]
    # [keys, B]
    expectation = np.array(
        [chosen(table, draw, "expectation") for draw in identify_draws(table, run["nll"], run["penalty"])]
    )
    # 4 standard errors of 200 draws
    assert np.all(np.abs(expectation.mean(0) - 0.5) < 0.15), expectation.mean(0)
    # independent images: 2 p (1 - p) = 0.5; 0 per batch
    differ = np.mean(expectation[:, 0] != expectation[:, 1])
    assert abs(differ - 0.5) < 0.15, differ


def test_objective_gradient_is_the_rules_for_its_draw(objective_draws):
    """The gradient the trainer takes at a key is the gradient of the rule's loss for that key's draw
    (NumPy's, by central differences, the reward held constant): on a batch with a caption on the
    expected context beside a sampled one, and on one with both sampled."""
    run, table = objective_draws, objective_draws["table"]
    draws = identify_draws(table, run["nll"], run["penalty"])
    kinds = [tuple(chosen(table, draw, "expectation")) for draw in draws]
    for kind in ((True, False), (False, False)):
        assert kind in kinds, f"no key drew {kind} (expected context, per caption)"
        key = kinds.index(kind)
        expectation, locations, rewards = (
            chosen(table, draws[key], name) for name in ("expectation", "locations", "rewards")
        )
        want = np_numerical_gradient(
            lambda w: rule_terms(w, run["annotations"], run["targets"], expectation, locations, rewards, RULE)[
                "loss"
            ].sum(),
            run["weights"],
        )
        assert want.keys() == run["grads"].keys()
        for name, value in want.items():
            np.testing.assert_allclose(
                run["grads"][name][key], value, rtol=1e-3, atol=1e-5, err_msg=f"{name}, draw {kind}"
            )


def test_hard_attention_estimator_is_unbiased():
    """The gradient of `Captioner.objective` with section 4.1's rule alone (REINFORCE with a baseline;
    the expectation trick, the entropy term and the penalty off) averaged over many draws equals the
    exact gradient of L_s = sum_s p(s | a) log p(y | s, a) (eq. 10): NumPy's, summed over all 16
    location sequences of a 2-word caption on a 2 x 2 grid and differentiated by central differences."""
    model = make(
        attention="hard",
        embed_dim=3,
        hidden_dim=3,
        attention_dim=3,
        vocab_size=5,
        reinforce_weight=1.0,
        # the rule alone
        expectation_probability=0.0,
        entropy_weight=0.0,
        doubly_stochastic=0.0,
    )
    annotations = np.random.default_rng(2).normal(size=(1, GRID, D)) * 2
    targets = np.array([[3, 2]])
    sequences = location_sequences(GRID, 2, 2)
    images, captions = np.repeat(annotations, len(sequences), 0), np.repeat(targets, len(sequences), 0)

    # L_s (eq. 10)
    def lower_bound(w):
        terms = caption_terms(w, images, captions, sequences)
        return np.sum(np.exp(terms["log_locations"]) * terms["log_likelihood"])

    weights = weights_of(model)
    np.testing.assert_allclose(
        np.exp(caption_terms(weights, images, captions, sequences)["log_locations"]).sum(), 1.0, rtol=1e-12
    )
    exact = np_numerical_gradient(lower_bound, weights)
    batch = {"inputs": jnp.float32(annotations), "targets": jnp.asarray(targets)}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # any constant: it shifts the estimate's variance, not its mean
    baseline = {"baseline": jnp.float32(-1.3)}

    # the gradient the trainer takes: of minus the model's own objective
    def estimate(key):
        def objective(params):
            loss, _, _ = nnx.merge(graphdef, params, rest).objective(batch, baseline, key, metrics.token_sums)
            return -loss

        return jax.grad(objective)(params)

    samples = weights_of(jax.jit(jax.vmap(estimate))(jax.random.split(jax.random.key(3), 20_000)))
    assert samples.keys() == exact.keys()
    checked = 0
    for name, want in exact.items():
        got = samples[name]
        mean, error = np.mean(got, axis=0), np.std(got, axis=0) / np.sqrt(got.shape[0])
        # within 5 standard errors
        np.testing.assert_array_less(np.abs(mean - want), 5 * error + 1e-4, err_msg=name)
        checked += np.sum(np.abs(want) > 10 * error)
    # enough coordinates whose gradient stands out of the noise (not a vacuous check)
    assert checked > 10


def test_teacher_forcing_equals_decoding_step_by_step():
    """The training pass with the expected context (soft attention, and hard attention's decoding)
    is the decoder's steps run one by one on the reference; from pixels, through the CNN."""
    model = models.create_model(
        "captioner",
        rngs=nnx.Rngs(0),
        vocab_size=V,
        conv_widths=(4, 4),
        pools=1,
        embed_dim=E,
        hidden_dim=N,
        attention_dim=A,
    )
    images = jnp.asarray(np.random.default_rng(6).integers(0, 256, size=(2, 6, 8, 1)), jnp.uint8)
    targets = jnp.asarray([[3, 5, 2, 0], [4, 6, 7, 2]])
    logits = model({"inputs": images, "targets": targets})
    memory = model.encode(images)
    # the 3 x 4 grid of a 6 x 8 image after one pool
    assert memory.annotations.shape == (2, 3 * 4, 4)
    state, previous = model.init_decode_state(memory, 2, 4), jnp.ones(2, jnp.int32)
    for t in range(4):
        step_logits, state = model.decode_step(memory, previous, state)
        np.testing.assert_allclose(step_logits, logits[:, t], rtol=1e-5, atol=1e-5)
        previous = targets[:, t]


def test_doubly_stochastic_penalty():
    weights = np.array([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.9, 0.05, 0.05]]])  # [1, T=3, L=3]
    # the third step is padding
    real = np.array([[1.0, 1.0, 0.0]])
    # sum over the real steps, by hand
    totals = np.array([0.6, 1.05, 0.35])
    np.testing.assert_allclose(
        doubly_stochastic_penalty(jnp.asarray(weights), jnp.asarray(real)), [np.sum((1 - totals) ** 2)], rtol=1e-6
    )
    # each location attended once over time
    permutation = jnp.eye(4)[jnp.asarray([2, 0, 3, 1])][None]
    assert float(doubly_stochastic_penalty(permutation, jnp.ones((1, 4)))[0]) == 0.0


def test_bad_fields_are_named():
    with pytest.raises(ConfigError, match="model.attention must be one of soft, hard"):
        make(attention="spotlight")
    with pytest.raises(ConfigError, match="model.feature_dim"):
        make(feature_dim=0)
