"""The recurrent families against float64 NumPy steps written from the papers' equations."""

import functools
import json
from importlib import import_module

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import base, recurrent
from engine import training_loop
from helpers.references import np_masked_softmax
from helpers.tiny import tiny_config
from models.attention import capture_attention
from models.rnn import LSTMState, RNNDecodeState, RNNMemory
from run_setup.run import prepare_run
from run_setup.settings import parse
from tasks.vocabularies import EOS_ID

# vocabulary, embedding, hidden
V, E, H = 13, 5, 6


def make(name, **fields):
    sizes = dict(vocab_size=V, embed_dim=E, hidden_dim=H, num_encoder_layers=1, num_decoder_layers=1)
    if name != "luong":
        sizes["maxout_dim"] = 4
    return models.create_model(name, rngs=nnx.Rngs(params=0, dropout=1), **{**sizes, **fields})


def source_batch(seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(3, V, (3, 7))
    # padding
    inputs[1, 4:] = 0
    inputs[2, 6:] = 0
    targets = rng.integers(3, V, (3, 5))
    targets[2, 3:] = 0
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


def f64(x):
    return np.asarray(x[...] if hasattr(x, "get_value") else x, np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def columns(kernel, parts):
    """A stacked kernel `[in, k*H]` as the paper's k separate matrices."""
    return np.split(f64(kernel), parts, axis=-1)


# ---------------------------------------------------------------- one step against the papers


def test_rnnsearch_decoder_step_is_bahdanau_appendix_a():
    model = make("rnnsearch", attention_dim=7)
    rng = np.random.default_rng(1)
    # h_j
    annotations = rng.normal(size=(3, 7, 2 * H))
    mask = np.ones((3, 7), bool)
    mask[1, 4:] = False
    # s_{i-1}
    previous_state = rng.normal(size=(3, H))
    # y_{i-1}
    previous_token = np.array([4, 7, 1])
    memory = RNNMemory(
        jnp.float32(annotations), model.cross_attention.project_keys(jnp.float32(annotations)), jnp.asarray(mask), None
    )
    logits, state = model.decode_step(
        memory, jnp.asarray(previous_token), RNNDecodeState((jnp.float32(previous_state),), None)
    )

    # e_ij = v_a^T tanh(W_a s_{i-1} + U_a h_j)  (A.1.2)
    attention = model.cross_attention
    W_a_s = previous_state @ f64(attention.query_proj.kernel)  # [B, A]
    U_a_h = annotations @ f64(attention.key_proj.kernel) + f64(attention.key_proj.bias)  # [B, S, A]
    e = np.tanh(W_a_s[:, None, :] + U_a_h) @ f64(attention.v)
    # eq. 6
    alpha = np_masked_softmax(e, mask)
    # eq. 5
    c = np.einsum("bj,bjd->bd", alpha, annotations)
    cell = model.decoder_cells[0]
    # E y_{i-1}
    embedded = f64(model.target_embed.embedding)[previous_token]
    W_z, W_r, W = columns(cell.input_proj.kernel, 3)
    b_z, b_r, b = np.split(f64(cell.input_proj.bias), 3)
    U_z, U_r = columns(cell.gate_proj.kernel, 2)
    U = f64(cell.candidate_proj.kernel)
    C_z, C_r, C = columns(model.context_proj.kernel, 3)
    z = sigmoid(embedded @ W_z + previous_state @ U_z + c @ C_z + b_z)
    r = sigmoid(embedded @ W_r + previous_state @ U_r + c @ C_r + b_r)
    candidate = np.tanh(embedded @ W + (r * previous_state) @ U + c @ C + b)
    # s_i
    s = (1 - z) * previous_state + z * candidate
    t_tilde = (
        s @ f64(model.readout_hidden.kernel)
        + f64(model.readout_hidden.bias)
        + embedded @ f64(model.readout_embedding.kernel)
        + c @ f64(model.readout_context.kernel)
    )
    # maxout over pairs (2j-1, 2j)
    t = np.maximum(t_tilde[:, 0::2], t_tilde[:, 1::2])
    # W_o t_i
    expected_logits = t @ f64(model.output.kernel) + f64(model.output.bias)

    np.testing.assert_allclose(state.layers[0], s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-5)


def test_rnnsearch_initial_state_is_tanh_of_the_first_backward_annotation():
    model = make("rnnsearch")
    memory = model.encode(source_batch()["inputs"])
    state = model.init_decode_state(memory, 3, 5)
    backward_first = f64(memory.annotations)[:, 0, H:]
    # s_0 = tanh(W_s h_1)
    expected = np.tanh(backward_first @ f64(model.initial_proj.kernel) + f64(model.initial_proj.bias))
    np.testing.assert_allclose(state.layers[0], expected, rtol=1e-5, atol=1e-6)


def np_gru(cell, inputs, h):
    """Cho et al. (2014) eqs. 5-8 (Bahdanau appendix A.1.1): one GRU step, float64.

    z = sigma(W_z x + U_z h), r = sigma(W_r x + U_r h), h~ = tanh(W x + U (r * h)), h' = (1 - z) h + z h~.
    """
    W_z, W_r, W = columns(cell.input_proj.kernel, 3)
    b_z, b_r, b = np.split(f64(cell.input_proj.bias), 3)
    U_z, U_r = columns(cell.gate_proj.kernel, 2)
    z = sigmoid(inputs @ W_z + h @ U_z + b_z)
    r = sigmoid(inputs @ W_r + h @ U_r + b_r)
    candidate = np.tanh(inputs @ W + (r * h) @ f64(cell.candidate_proj.kernel) + b)
    return (1 - z) * h + z * candidate


def np_encoder_direction(cell, embedded, length, reverse):
    """One direction of a one-layer GRU encoder over the first `length` positions of one source:
    the states `[S, H]` (zero at padding) and the final state."""
    states = np.zeros((embedded.shape[0], H))
    h = np.zeros(H)
    order = range(length - 1, -1, -1) if reverse else range(length)
    for j in order:
        h = np_gru(cell, embedded[j], h)
        states[j] = h
    return states, h


def test_bidirectional_encoder_is_bahdanau_section_3_2():
    """Annotations h_j = [forward h_j; backward h_j] of a padded batch, against a float64 GRU."""
    model = make("rnnsearch")
    inputs = source_batch()["inputs"]
    annotations = np.asarray(model.encode(inputs).annotations)  # [B, S, 2H]
    table = f64(model.source_embed.embedding)
    for row, source in enumerate(np.asarray(inputs)):
        length = int((source != 0).sum())
        forward, _ = np_encoder_direction(model.encoder.forward_cells[0], table[source], length, reverse=False)
        backward, _ = np_encoder_direction(model.encoder.backward_cells[0], table[source], length, reverse=True)
        np.testing.assert_allclose(annotations[row], np.concatenate([forward, backward], axis=-1), rtol=1e-5, atol=1e-6)


def test_rnnencdec_is_cho_et_al_section_2_2():
    """c = tanh(V h_N) from the last real token; s_0 = tanh(V' c); c enters every decoder step."""
    model = make("rnnencdec")
    batch = source_batch()
    memory = model.encode(batch["inputs"])
    table = f64(model.source_embed.embedding)
    expected_c = []
    for source in np.asarray(batch["inputs"]):
        _, h_N = np_encoder_direction(
            model.encoder.forward_cells[0], table[source], int((source != 0).sum()), reverse=False
        )
        # c = tanh(V h_N)
        expected_c.append(np.tanh(h_N @ f64(model.summary_proj.kernel) + f64(model.summary_proj.bias)))
    c = np.array(expected_c)
    np.testing.assert_allclose(memory.initial, c, rtol=1e-5, atol=1e-6)
    state = model.init_decode_state(memory, 3, 5)
    # s_0 = tanh(V' c)
    s_0 = np.tanh(c @ f64(model.initial_proj.kernel) + f64(model.initial_proj.bias))
    np.testing.assert_allclose(state.layers[0], s_0, rtol=1e-5, atol=1e-6)

    previous_token = np.array([1, 5, 9])
    logits, state = model.decode_step(memory, jnp.asarray(previous_token), state)
    embedded = f64(model.target_embed.embedding)[previous_token]
    # the summary in every gate (Bahdanau A.2.2 with c_i fixed)
    C_z, C_r, C = columns(model.context_proj.kernel, 3)
    cell = model.decoder_cells[0]
    W_z, W_r, W = columns(cell.input_proj.kernel, 3)
    b_z, b_r, b = np.split(f64(cell.input_proj.bias), 3)
    U_z, U_r = columns(cell.gate_proj.kernel, 2)
    z = sigmoid(embedded @ W_z + s_0 @ U_z + c @ C_z + b_z)
    r = sigmoid(embedded @ W_r + s_0 @ U_r + c @ C_r + b_r)
    s_1 = (1 - z) * s_0 + z * np.tanh(embedded @ W + (r * s_0) @ f64(cell.candidate_proj.kernel) + c @ C + b)
    np.testing.assert_allclose(state.layers[0], s_1, rtol=1e-5, atol=1e-6)
    t_tilde = (
        s_1 @ f64(model.readout_hidden.kernel)
        + f64(model.readout_hidden.bias)
        + embedded @ f64(model.readout_embedding.kernel)
        + c @ f64(model.readout_context.kernel)
    )
    t = np.maximum(t_tilde[:, 0::2], t_tilde[:, 1::2])
    np.testing.assert_allclose(logits, t @ f64(model.output.kernel) + f64(model.output.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score", ["dot", "general", "concat"])
def test_luong_decoder_step_with_input_feeding(score):
    model = make("luong", score=score, attention_dim=7)
    rng = np.random.default_rng(2)
    # h_s
    source_states = rng.normal(size=(3, 7, H))
    mask = np.ones((3, 7), bool)
    mask[2, 2:] = False
    # h_{t-1}, c_{t-1}, h~_{t-1}
    h, c, feed = (rng.normal(size=(3, H)) for _ in range(3))
    previous_token = np.array([5, 1, 9])
    memory = RNNMemory(
        jnp.float32(source_states),
        model.cross_attention.project_keys(jnp.float32(source_states)),
        jnp.asarray(mask),
        None,
    )
    start = RNNDecodeState((LSTMState(jnp.float32(h), jnp.float32(c)),), jnp.float32(feed))
    logits, state = model.decode_step(memory, jnp.asarray(previous_token), start)

    # the LSTM reads [E y_{t-1}; h~_{t-1}] (input feeding, section 3.3)
    cell = model.decoder_cells[0]
    inputs = np.concatenate([f64(model.target_embed.embedding)[previous_token], feed], axis=-1)
    W = np.concatenate([f64(cell.input_proj.kernel), f64(model.feed_proj.kernel)], axis=0)
    i, f, o, g = np.split(inputs @ W + h @ f64(cell.hidden_proj.kernel) + f64(cell.input_proj.bias), 4, axis=-1)
    c_t = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    h_t = sigmoid(o) * np.tanh(c_t)
    # section 3.1's scores
    attention = model.cross_attention
    if score == "dot":
        scores = np.einsum("bh,bsh->bs", h_t, source_states)
    elif score == "general":
        # h_t^T W_a h_s
        scores = np.einsum("bh,bsh->bs", h_t, source_states @ f64(attention.key_proj.kernel))
    else:
        # v_a^T tanh(W_a [h_t; h_s])
        W_a = np.concatenate([f64(attention.query_proj.kernel), f64(attention.key_proj.kernel)], axis=0)
        both = np.concatenate([np.broadcast_to(h_t[:, None], source_states.shape), source_states], axis=-1)
        scores = np.tanh(both @ W_a + f64(attention.key_proj.bias)) @ f64(attention.v)
    # eq. 7
    a = np_masked_softmax(scores, mask)
    context = np.einsum("bs,bsh->bh", a, source_states)
    # eq. 5
    attentional = np.tanh(np.concatenate([context, h_t], axis=-1) @ f64(model.attentional.kernel))
    # eq. 6
    expected_logits = attentional @ f64(model.output.kernel) + f64(model.output.bias)

    np.testing.assert_allclose(state.layers[0].hidden, h_t, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.layers[0].cell, c_t, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.feed, attentional, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the whole pass

FAMILIES = [
    ("rnnencdec", {}),
    ("rnnsearch", {}),
    ("rnnsearch", dict(cell="lstm", num_encoder_layers=2, num_decoder_layers=2)),
    ("luong", dict(score="general")),
    ("luong", dict(score="concat", cell="gru", num_encoder_layers=2, num_decoder_layers=2, input_feeding=False)),
]


@pytest.mark.parametrize("name, fields", FAMILIES)
def test_decode_step_by_step_reproduces_teacher_forced_logits(name, fields):
    model = make(name, dropout_rate=0.3, **fields)
    batch = source_batch()
    # deterministic
    teacher_forced = model(batch)
    memory = model.encode(batch["inputs"])
    state = model.init_decode_state(memory, 3, 5)
    # bos
    previous, step_logits = jnp.ones(3, jnp.int32), []
    for t in range(5):
        logits, state = model.decode_step(memory, previous, state)
        step_logits.append(logits)
        previous = batch["targets"][:, t]
    np.testing.assert_allclose(jnp.stack(step_logits, axis=1), teacher_forced, rtol=1e-5, atol=1e-5)
    # dropout is on in training
    assert not np.allclose(model(batch, deterministic=False), teacher_forced)


@pytest.mark.parametrize("name", ["rnnsearch", "luong"])
def test_padded_source_positions_get_zero_attention_and_change_nothing(name):
    model = make(name)
    batch = source_batch()
    weights = capture_attention(model, batch)["cross_attention"]  # [B, 1, T, S]
    padding = np.asarray(batch["inputs"] == 0)[:, None, None, :]
    assert np.all(np.where(padding, np.asarray(weights), 0.0) == 0.0)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    # more padding
    longer = dict(batch, inputs=jnp.pad(batch["inputs"], ((0, 0), (0, 4))))
    np.testing.assert_allclose(model(longer), model(batch), rtol=1e-5, atol=1e-6)


def test_backward_annotation_at_j_depends_only_on_positions_from_j():
    model = make("rnnsearch", num_encoder_layers=2, num_decoder_layers=1)
    inputs = source_batch()["inputs"]
    j = 3
    # other tokens before j
    changed = inputs.at[:, :j].set((inputs[:, :j] + 1 - 3) % (V - 3) + 3)
    original, other = (np.asarray(model.encode(x).annotations) for x in (inputs, changed))
    # backward half, from j on
    np.testing.assert_array_equal(other[:, j:, H:], original[:, j:, H:])
    # ... but not before j
    assert not np.allclose(other[:, j - 1, H:], original[:, j - 1, H:])
    # the forward half sees the change
    assert not np.allclose(other[:, j, :H], original[:, j, :H])


def test_bad_family_fields_name_the_culprit():
    with pytest.raises(ValueError, match="num_encoder_layers"):
        make("luong", num_encoder_layers=2, num_decoder_layers=1)
    with pytest.raises(ValueError, match="model.cell"):
        make("rnnsearch", cell="rnn")
    with pytest.raises(ValueError, match="unknown field.*score"):
        # RNNsearch's alignment is additive by definition
        make("rnnsearch", score="dot")
    with pytest.raises(ValueError, match="bucket"):
        make("rnnsearch")(dict(source_batch(), inputs_segment_ids=jnp.ones((3, 7), jnp.int32)))


# ---------------------------------------------------------------- configs and the trainer


@pytest.mark.parametrize("family", recurrent.FAMILIES)
@pytest.mark.parametrize("task", sorted(recurrent.TASKS))
def test_every_family_and_task_config_builds_its_model(family, task):
    config = import_module(f"configs.{family}_{task}").get_config()
    assert config.model.name == family and config.data.batching == "bucket"
    fields = {k: v for k, v in config.model.to_dict().items() if k != "name"}

    def build():
        return models.create_model(family, rngs=nnx.Rngs(0), vocab_size=V, **fields)

    # the other tasks' models differ only in size: built abstractly (their fields' checks run, no
    # arrays: kjv_web's 512-unit models took seconds to initialise)
    if task == "dates":
        assert build()(source_batch()).shape == (3, 5, V)
    else:
        nnx.eval_shape(build)


@pytest.mark.slow
def test_rnnsearch_trains_in_the_trainer_and_draws_its_alignment(shared_data_dir, tmp_path):
    fields = recurrent.model_fields("rnnsearch", "dates")
    fields.update(embed_dim=16, hidden_dim=16, maxout_dim=8, attention_dim=16)
    config = tiny_config(
        shared_data_dir,
        visualize_examples=1,
        learning_rate=1e-2,
        schedule="constant",
        warmup_steps=10,
        num_train_steps=200,
        eval_every_steps=200,
        checkpoint_every_steps=200,
    )
    # tiny_config locks it
    config.unlock()
    config.model = base.model("rnnsearch", **fields)
    config.data.batching = "bucket"
    final = training_loop.train_and_evaluate(parse(config), tmp_path)
    # the reported alignment accuracy, recomputed here from the restored model's attention: for each
    # dev example, the share of the year's, month's and day's target characters whose most-attended
    # source character lies in the field's true source span
    run = prepare_run(parse(config), tmp_path)
    model = run.model(run.restore_params()[1])
    records = list(run.task.splits["dev"])

    def padded(texts, vocabulary, limit):  # [B, limit] ids ending in eos, trimmed as evaluation trims
        rows = np.zeros((len(texts), limit), np.int32)
        for row, text in enumerate(texts):
            ids = [*vocabulary.encode(text)[: limit - 1], EOS_ID]
            rows[row, : len(ids)] = ids
        return jnp.asarray(rows)

    pairs = [run.task.pair(record) for record in records]
    batch = {
        "inputs": padded([s for s, _ in pairs], run.tokens.source, config.data.max_source_length),
        "targets": padded([t for _, t in pairs], run.tokens.target, config.data.max_target_length),
    }
    attended = np.asarray(capture_attention(model, batch)["cross_attention"])[:, 0].argmax(axis=-1)  # [B, T]
    per_example = []
    for row, record in enumerate(records):
        # YYYY-MM-DD against source spans
        fields = zip(((0, 4), (5, 7), (8, 10)), record["alignment"])
        hits = [start <= attended[row, t] < end for (t0, t1), (start, end) in fields for t in range(t0, t1)]
        per_example.append(np.mean(hits))
    assert final["dev"]["alignment_accuracy"] == pytest.approx(np.mean(per_example), abs=1e-9)
    # 200 steps teach even this 16-unit RNNsearch where the fields are: 0.78 when written, against
    # about 0.2 for attention that ignores the source (the year's 4 characters of ~20)
    assert final["dev"]["alignment_accuracy"] > 0.6
    assert list((tmp_path / "attention" / "step_200").glob("example_0_cross_attention.png"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    # it learns
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("task", ["copy", "kjv_web"])
def test_length_experiment_gives_every_family_one_budget(task):
    from benchmarks import length_experiment

    configs = {f: length_experiment.experiment_config(f, task, 123, "data/tfds") for f in length_experiment.FAMILIES}
    assert {c.model.name for c in configs.values()} == set(length_experiment.FAMILIES)
    for field in ("num_train_steps", "batch_size", "warmup_steps", "schedule", "data.batching", "task.name"):
        values = {str(functools.reduce(getattr, field.split("."), c)) for c in configs.values()}
        assert len(values) == 1, (field, values)
    if task == "copy":
        assert configs["rnnsearch"].task.max_length == 100 and configs["rnnsearch"].data.max_source_length == 101
