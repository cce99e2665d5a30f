"""LSTMN (Cheng et al. 2016) against float64 NumPy steps written from eqs. 4-16 (arXiv:1601.06733v7's
numbering, as models/lstmn.py's), and its masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

import models
from helpers.references import np_masked_softmax
from models.attention import AttentionRole, attention_roles, capture_attention
from models.lstmn import LSTMNDecodeState, LSTMNMemory, Tapes, tape_scan, write_at
from scoring import decoding
from utils.errors import ConfigError

V, E, H, A = 13, 5, 6, 7


def make(**fields):
    sizes = dict(vocab_size=V, embed_dim=E, hidden_dim=H, attention_dim=A, num_encoder_layers=1, num_decoder_layers=1)
    return models.create_model("lstmn", rngs=nnx.Rngs(params=0, dropout=1), **{**sizes, **fields})


def f64(x):
    return np.asarray(x[...] if hasattr(x, "get_value") else x, np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def random_tapes(rng, batch, length, written_lengths):
    written = np.zeros((batch, length), bool)
    for row, count in enumerate(written_lengths):
        written[row, :count] = True
    hidden, memory = rng.normal(size=(batch, length, H)), rng.normal(size=(batch, length, H))
    # h_i, c_i, which are written, h~_{t-1}
    return hidden, memory, written, rng.normal(size=(batch, H))


def np_intra_attention(cell, hidden, memory, written, summary, x):
    """Eqs. 4-6, float64."""
    # W_h h_i
    keys = hidden @ f64(cell.key_proj.kernel)
    query = (
        x @ f64(cell.input_attention.kernel)
        + f64(cell.input_attention.bias)
        + summary @ f64(cell.summary_attention.kernel)
    )
    # eq. 4
    a = np.tanh(keys + query[:, None, :]) @ f64(cell.v)
    # eq. 5, positions < t only
    s = np_masked_softmax(a, written)
    # eq. 6
    return np.einsum("bl,blh->bh", s, hidden), np.einsum("bl,blh->bh", s, memory), s


def np_gates(cell, inputs):
    """Eq. 7: [i; f; o; c^] = [sigma; sigma; sigma; tanh](W inputs + b)."""
    i, f, o, c_hat = np.split(inputs @ f64(cell.gates.kernel) + f64(cell.gates.bias), 4, axis=-1)
    return sigmoid(i), sigmoid(f), sigmoid(o), np.tanh(c_hat)


def as_tapes(cell, hidden, memory, written, summary):
    keys = jnp.float32(hidden) @ cell.key_proj.kernel[...]
    return Tapes(jnp.float32(hidden), jnp.float32(memory), keys, jnp.asarray(written), jnp.float32(summary))


# positions before t = 4
@pytest.mark.parametrize("written_lengths", [(0, 2, 4), (3, 1, 4)])
def test_cell_step_is_eqs_4_to_9(written_lengths):
    cell = make().encoder_cells[0]
    rng = np.random.default_rng(sum(written_lengths))
    hidden, memory, written, summary = random_tapes(rng, 3, 6, written_lengths)
    x = rng.normal(size=(3, E))
    position = 4
    # the third row is padding at this step
    real = np.array([True, True, False])
    tapes, h, weights = cell(
        as_tapes(cell, hidden, memory, written, summary), jnp.float32(x), jnp.array(position), jnp.asarray(real)
    )

    h_tilde, c_tilde, s = np_intra_attention(cell, hidden, memory, written, summary, x)
    i, f, o, c_hat = np_gates(cell, np.concatenate([h_tilde, x], axis=-1))
    # eq. 8
    c = f * c_tilde + i * c_hat
    # eq. 9
    expected_h = o * np.tanh(c)
    np.testing.assert_allclose(weights, s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h, expected_h, rtol=1e-5, atol=1e-5)
    # written at `position` for real rows; padding leaves the tapes alone
    for row in range(3):
        expected_hidden = hidden[row].copy()
        if real[row]:
            expected_hidden[position] = expected_h[row]
        np.testing.assert_allclose(tapes.hidden[row], expected_hidden, rtol=1e-5, atol=1e-5)
        assert bool(tapes.written[row, position]) == real[row]
    np.testing.assert_allclose(tapes.memory[0, position], c[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tapes.keys[1, position], expected_h[1] @ f64(cell.key_proj.kernel), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tapes.summary[:2], h_tilde[:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tapes.summary[2], summary[2], rtol=1e-6)


def np_lstmn_layer(cell, x, length):
    """Eqs. 4-9 over the first `length` positions of one sequence `x [L, Din]`, float64: the tapes
    `(h [L, H], c [L, H])`, zero past `length`."""
    hidden, memory = np.zeros((len(x), H)), np.zeros((len(x), H))
    summary = np.zeros(H)
    for t in range(length):
        written = (np.arange(len(x)) < t)[None]
        h_tilde, c_tilde, _ = np_intra_attention(cell, hidden[None], memory[None], written, summary[None], x[t][None])
        i, f, o, c_hat = np_gates(cell, np.concatenate([h_tilde, x[t][None]], axis=-1))
        memory[t] = (f * c_tilde + i * c_hat)[0]
        hidden[t] = (o * np.tanh(memory[t]))[0]
        summary = h_tilde[0]
    return hidden, memory


def test_two_layer_encoder_tapes_are_eqs_4_to_9_layer_on_layer():
    """encode(): each padded source against a float64 run of eqs. 4-9, the second layer over the
    first layer's hidden tape (eq. 10); the memory handed to the decoder is the top layer's two tapes."""
    model = make(num_encoder_layers=2)
    inputs = batch_of()["inputs"]
    memory = model.encode(inputs)
    table = f64(model.source_embed.embedding)
    for row, source in enumerate(np.asarray(inputs)):
        length = int((source > 0).sum())
        first, _ = np_lstmn_layer(model.encoder_cells[0], table[source], length)
        hidden, cells = np_lstmn_layer(model.encoder_cells[1], first, length)
        np.testing.assert_allclose(memory.hidden[row], hidden, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(memory.memory[row], cells, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(memory.mask, np.asarray(inputs) > 0)


@pytest.mark.parametrize("fusion", ["shallow", "deep"])
def test_fused_decoder_step_is_eqs_11_to_16(fusion):
    model = make(fusion=fusion, inter_query="word_and_context")
    rng = np.random.default_rng(7)
    # the encoder's tapes
    gamma, alpha = rng.normal(size=(3, 5, H)), rng.normal(size=(3, 5, H))
    source_mask = np.ones((3, 5), bool)
    source_mask[1, 3:] = False
    memory = LSTMNMemory(
        jnp.float32(gamma),
        jnp.float32(alpha),
        model.cross_attention.project_keys(jnp.float32(gamma)),
        jnp.asarray(source_mask),
    )
    cell = model.decoder_cells[0]
    hidden, memory_tape, written, summary = random_tapes(rng, 3, 6, (2, 2, 2))
    # gamma~_{t-1}
    previous_context = rng.normal(size=(3, H))
    tapes = (as_tapes(cell, hidden, memory_tape, written, summary),)
    # eq. 11 reads no h_{t-1}
    state = LSTMNDecodeState(tapes, jnp.float32(previous_context), jnp.array(2), jnp.zeros((3, H)))
    token = np.array([4, 7, 1])
    logits, new_state = model.decode_step(memory, jnp.asarray(token), state)

    # x_t, the previous word
    x = f64(model.target_embed.embedding)[token]
    # eq. 11: u^T tanh(W_gamma gamma_j + W_x x_t + W_gamma~ gamma~_{t-1})
    attention = model.cross_attention
    query = np.concatenate([x, previous_context], axis=-1) @ f64(attention.query_proj.kernel)
    b = np.tanh(gamma @ f64(attention.key_proj.kernel) + f64(attention.key_proj.bias) + query[:, None, :]) @ f64(
        attention.v
    )
    # eq. 12
    p = np_masked_softmax(b, source_mask)
    # eq. 13
    gamma_tilde = np.einsum("bj,bjh->bh", p, gamma)
    alpha_tilde = np.einsum("bj,bjh->bh", p, alpha)
    h_tilde, c_tilde, _ = np_intra_attention(cell, hidden, memory_tape, written, summary, x)
    # the context in every gate, as RNNsearch's C c_i
    if fusion == "shallow":
        i, f, o, c_hat = np_gates(cell, np.concatenate([h_tilde, x, gamma_tilde], axis=-1))
        c = f * c_tilde + i * c_hat
    else:
        i, f, o, c_hat = np_gates(cell, np.concatenate([h_tilde, x], axis=-1))
        # eq. 14
        r = sigmoid(np.concatenate([gamma_tilde, x], axis=-1) @ f64(cell.fusion.kernel) + f64(cell.fusion.bias))
        # eq. 15
        c = r * alpha_tilde + f * c_tilde + i * c_hat
    # eq. 9 (eq. 16 under deep fusion)
    h = o * np.tanh(c)
    expected = np.concatenate([h, gamma_tilde], axis=-1) @ f64(model.output.kernel) + f64(model.output.bias)
    np.testing.assert_allclose(new_state.context, gamma_tilde, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_state.tapes[0].memory[:, 2], c, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


# -- the whole encoder-decoder, from the equations alone ---------------------------------------------


def randomize(model, seed, scale=0.5):
    """Every parameter redrawn from N(0, scale^2), biases included (they start at 0, or 1 for the
    forget gate), so that no term of an equation is zero or negligible and dropping one shows."""
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            node[...] = jnp.asarray(rng.normal(scale=scale, size=node.shape), node.dtype)


def paper_weights(model):
    """The module's parameters as float64 arrays under the equations' names; the only thing the
    reference below takes from the module. Its biases inside the tanh of eqs. 4 and 11 (`b_x`,
    `b_gamma`) are the module's, which the paper does not write."""
    E = model.config.embed_dim

    def layer(cell):
        names = dict(
            W_h=cell.key_proj.kernel,
            W_x=cell.input_attention.kernel,
            b_x=cell.input_attention.bias,
            W_htilde=cell.summary_attention.kernel,
            v=cell.v,
            W=cell.gates.kernel,
            b=cell.gates.bias,
        )
        if cell.fusion is not None:
            names.update(W_r=cell.fusion.kernel, b_r=cell.fusion.bias)
        return {name: f64(value) for name, value in names.items()}

    inter = model.cross_attention
    # over [x_t; gamma~_{t-1}] (eq. 11) or h_{t-1} (eq. 11')
    query = f64(inter.query_proj.kernel)
    query_weights = (
        dict(W_x=query[:E], W_gammatilde=query[E:]) if model.config.query == "word_and_context" else dict(W_s=query)
    )
    return dict(
        source_embed=f64(model.source_embed.embedding),
        target_embed=f64(model.target_embed.embedding),
        encoder=[layer(cell) for cell in model.encoder_cells],
        decoder=[layer(cell) for cell in model.decoder_cells],
        # eq. 11's W_gamma (and bias), u; W_x and W_gamma~ (eq. 11) or W_s (eq. 11')
        W_gamma=f64(inter.key_proj.kernel),
        b_gamma=f64(inter.key_proj.bias),
        **query_weights,
        u=f64(inter.v),
        W_out=f64(model.output.kernel),
        b_out=f64(model.output.bias),
    )


def paper_softmax(scores):
    """Eqs. 5 and 12 over a non-empty list of scores."""
    e = np.exp(np.asarray(scores) - np.max(scores))
    return e / e.sum()


def paper_lstmn_step(w, hs, cs, h_tilde_previous, x, fusion=None, gamma_tilde=None, alpha_tilde=None):
    """Step t of one LSTMN layer: the tapes `hs = [h_1 .. h_{t-1}]`, `cs = [c_1 .. c_{t-1}]` (lists, one
    vector per earlier token), eqs. 4-9; in the decoder's first layer, the context gamma~_t in the gates
    (`fusion="shallow"`) or alpha~_t gated into the memory (`"deep"`, eqs. 14-16). Returns h_t, c_t, h~_t."""
    if hs:
        # (4)
        a = [
            np.tanh(h_i @ w["W_h"] + x @ w["W_x"] + w["b_x"] + h_tilde_previous @ w["W_htilde"]) @ w["v"] for h_i in hs
        ]
        s = paper_softmax(a)  # (5)
        h_tilde = sum(s_i * h_i for s_i, h_i in zip(s, hs))  # (6)
        c_tilde = sum(s_i * c_i for s_i, c_i in zip(s, cs))
    else:
        # t = 1: nothing to read
        h_tilde = c_tilde = np.zeros_like(h_tilde_previous)
    gate_input = [h_tilde, x] + ([gamma_tilde] if fusion == "shallow" else [])
    i, f, o, c_hat = np.split(np.concatenate(gate_input) @ w["W"] + w["b"], 4)  # (7)
    c = sigmoid(f) * c_tilde + sigmoid(i) * np.tanh(c_hat)  # (8)
    if fusion == "deep":
        r = sigmoid(np.concatenate([gamma_tilde, x]) @ w["W_r"] + w["b_r"])  # (14)
        c = r * alpha_tilde + c  # (15)
    h = sigmoid(o) * np.tanh(c)  # (9), (16)
    return h, c, h_tilde


def paper_lstmn_run(layers, xs, zero_slot=False):
    """A stack of LSTMN layers over the vectors `xs`, each layer reading the hidden states of the one
    below (eq. 10): every layer's tapes `([h_1 ..], [c_1 ..])`, each starting with `h_0 = c_0 = 0` when
    `zero_slot` (the authors' code: a slot every step reads, which the layer above does not)."""
    runs = []
    for layer in layers:
        size = len(layer["W_htilde"])
        hs, cs = ([np.zeros(size)], [np.zeros(size)]) if zero_slot else ([], [])
        # h~_0 = 0
        h_tilde = np.zeros(size)
        for x in xs:
            h, c, h_tilde = paper_lstmn_step(layer, hs, cs, h_tilde, x)
            hs.append(h)
            cs.append(c)
        runs.append((hs, cs))
        xs = hs[1:] if zero_slot else hs
    return runs


def paper_encoder_decoder(w, source, target, fusion, bos, query="word_and_context", seed=False):
    """Teacher-forced logits `[len(target), V]` of the section-4 encoder-decoder for one unpadded example:
    the encoder's top-layer tapes gamma, alpha; at every target step, inter-attention (eqs. 11-13) from the
    previous word x_t and gamma~_{t-1} (`query="word_and_context"`) or from the top decoder layer's previous
    hidden state, the last on its tape (`"previous_state"`, Bahdanau's, eq. 11'), the decoder layers bottom up,
    the first with the source in its gates or its memory, and the output layer over [h_t of the top
    layer; gamma~_t]. `seed`: the tapes start as the authors' code starts them, the encoder's with a
    zero slot, decoder layer l's with encoder layer l's last (h, c)."""
    runs = paper_lstmn_run(w["encoder"], [w["source_embed"][word] for word in source], zero_slot=seed)
    gamma, alpha = runs[-1]
    hidden = len(gamma[0])
    # h, c tapes per layer
    tapes = [([hs[-1]], [cs[-1]]) for hs, cs in runs] if seed else [([], []) for _ in w["decoder"]]
    # h~_{t-1} per layer
    summaries = [np.zeros(hidden) for _ in w["decoder"]]
    # gamma~_0
    gamma_tilde = np.zeros(hidden)
    logits = []
    for previous in [bos, *target[:-1]]:
        x = w["target_embed"][previous]
        if query == "word_and_context":
            terms = x @ w["W_x"] + gamma_tilde @ w["W_gammatilde"]
        else:
            # s_{t-1}: the top decoder layer's latest state, 0 before the first (Bahdanau's e_ij = a(s_{i-1}, h_j))
            top = tapes[-1][0]
            terms = (top[-1] if top else np.zeros(hidden)) @ w["W_s"]
        b = [np.tanh(g_j @ w["W_gamma"] + w["b_gamma"] + terms) @ w["u"] for g_j in gamma]  # (11), (11')
        p = paper_softmax(b)  # (12)
        gamma_tilde = sum(p_j * g_j for p_j, g_j in zip(p, gamma))  # (13)
        alpha_tilde = sum(p_j * a_j for p_j, a_j in zip(p, alpha))
        layer_input = x
        for index, (layer, (hs, cs)) in enumerate(zip(w["decoder"], tapes)):
            source_terms = dict(fusion=fusion, gamma_tilde=gamma_tilde, alpha_tilde=alpha_tilde) if index == 0 else {}
            h, c, summaries[index] = paper_lstmn_step(layer, hs, cs, summaries[index], layer_input, **source_terms)
            hs.append(h)
            cs.append(c)
            layer_input = h
        logits.append(np.concatenate([layer_input, gamma_tilde]) @ w["W_out"] + w["b_out"])
    return np.array(logits)


VARIANTS = [  # (fusion, inter_query, seed_tapes)
    ("shallow", "previous_state", False),
    ("shallow", "word_and_context", False),
    ("deep", "word_and_context", False),
    ("shallow", "previous_state", True),
    ("deep", "word_and_context", True),
]


@pytest.mark.parametrize("fusion, query, seed", VARIANTS)
def test_two_layer_encoder_decoder_logits_are_the_papers_equations(fusion, query, seed):
    """The module's teacher-forced logits (two encoder and two decoder layers, three source and three
    target words) against `paper_encoder_decoder`, written from eqs. 4-16 with lists for tapes: it takes
    the module's weights (all redrawn, so that every term counts) and nothing else of the module, nor
    the step helpers above. The second source has two words and padding: the module on the padded batch
    gives what the reference gives on the two words (under `seed_tapes`, its final state is the second
    word's, not the padding's). `embed_dim = hidden_dim`, so that a layer fed the wrong layer's input
    computes (wrongly) instead of failing on a shape."""
    model = make(
        fusion=fusion,
        inter_query=query,
        seed_tapes=seed,
        embed_dim=4,
        hidden_dim=4,
        attention_dim=3,
        num_encoder_layers=2,
        num_decoder_layers=2,
    )
    randomize(model, seed=11)
    sources = np.array([[5, 9, 3], [7, 4, 0]])
    targets = np.array([[6, 3, 11], [8, 8, 12]])
    logits = np.asarray(model({"inputs": jnp.asarray(sources), "targets": jnp.asarray(targets)}))
    w = paper_weights(model)
    for row in range(2):
        source = sources[row][sources[row] > 0]
        expected = paper_encoder_decoder(w, source, targets[row], fusion, model.config.bos_id, query, seed)
        np.testing.assert_allclose(logits[row], expected, rtol=1e-5, atol=1e-6)


def batch_of(seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(3, V, (3, 7))
    inputs[1, 4:] = 0
    inputs[2, 6:] = 0
    targets = rng.integers(3, V, (3, 5))
    targets[2, 3:] = 0
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}


@pytest.mark.parametrize("fusion", ["shallow", "deep"])
def test_intra_attention_sees_only_earlier_real_positions(fusion):
    model = make(fusion=fusion, num_encoder_layers=2, num_decoder_layers=2)
    batch = batch_of()
    logits = np.asarray(model(batch))
    # a later target token changes nothing before it, bit for bit
    j = 3
    # another real token, padding left as it is
    other = (batch["targets"] + 1 - 3) % (V - 3) + 3
    later = dict(batch, targets=batch["targets"].at[:, j:].set(jnp.where(batch["targets"][:, j:] > 0, other[:, j:], 0)))
    np.testing.assert_array_equal(np.asarray(model(later))[:, : j + 1], logits[:, : j + 1])
    memory, later_memory = model.encode(batch["inputs"]), model.encode(later["inputs"].at[:, 5:].set(4))
    np.testing.assert_array_equal(np.asarray(later_memory.hidden)[0, :5], np.asarray(memory.hidden)[0, :5])
    # a padded row gives what the example gives alone
    for row in range(3):
        source, target = int((batch["inputs"][row] > 0).sum()), int((batch["targets"][row] > 0).sum())
        alone = model(
            {"inputs": batch["inputs"][row : row + 1, :source], "targets": batch["targets"][row : row + 1, :target]}
        )
        np.testing.assert_allclose(np.asarray(alone)[0], logits[row, :target], rtol=1e-5, atol=1e-6)
    weights = capture_attention(model, batch)
    roles = attention_roles(model)
    assert (
        roles["encoder_cells/1"] is AttentionRole.SOURCE_SELF and roles["decoder_cells/0"] is AttentionRole.TARGET_SELF
    )
    intra = np.asarray(weights["encoder_cells/0"])[:, 0]  # [B, S, S]: word t over the words before it
    # only i < t
    assert np.all(np.triu(intra, k=0) == 0.0)
    # never padding
    assert np.all(intra[1][:, 4:] == 0.0)


@pytest.mark.parametrize(
    "fields", [dict(fusion="shallow"), dict(fusion="deep"), dict(seed_tapes=True, num_encoder_layers=2)]
)
def test_decode_step_by_step_reproduces_teacher_forcing(fields):
    model = make(**{"num_decoder_layers": 2, "dropout_rate": 0.3, **fields})
    batch = batch_of(1)
    teacher_forced = model(batch)
    memory = model.encode(batch["inputs"])
    state, previous, steps = model.init_decode_state(memory, 3, 5), jnp.ones(3, jnp.int32), []
    for t in range(5):
        logits, state = model.decode_step(memory, previous, state)
        steps.append(logits)
        previous = batch["targets"][:, t]
    real = np.asarray(batch["targets"] > 0)
    np.testing.assert_allclose(
        np.asarray(jnp.stack(steps, 1))[real], np.asarray(teacher_forced)[real], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("fields", [dict(fusion="deep"), dict(seed_tapes=True)])
def test_beam_search_gives_each_padded_row_what_it_gives_alone(fields):
    """Under `seed_tapes` too: the seeds are the last real token's state, and beam search reorders them."""
    model = make(**fields)
    inputs = batch_of(2)["inputs"]
    search = jax.jit(
        lambda x: decoding.beam_search(model, x, decoding.source_lengths(x) + 3, 10, beam_size=3, alpha=0.6)
    )
    tokens, scores = search(inputs)
    for row in range(3):
        alone_tokens, alone_scores = search(inputs[row : row + 1, : int((inputs[row] > 0).sum())])
        np.testing.assert_array_equal(alone_tokens[0], tokens[row])
        np.testing.assert_allclose(alone_scores[0], scores[row], rtol=1e-5, atol=1e-6)


# seeded: also through the decoder's first slots into the encoder
@pytest.mark.parametrize("seed", [False, True])
def test_gradient_through_the_tapes_matches_finite_differences(seed):
    model = make(fusion="deep", seed_tapes=seed, embed_dim=3, hidden_dim=3, attention_dim=3)
    # a padded source and a padded target among 2 rows
    batch = {k: v[1:] for k, v in batch_of(3).items()}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(batch)
        return jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(batch["targets"], V))

    grads = jax.jit(jax.grad(loss))(params)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    with jax.enable_x64():
        params64 = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        check_grads(jax.jit(loss), (params64,), order=1, modes=["rev"], atol=1e-4, rtol=1e-4)


def test_tape_scan_gradient_equals_autodiff_through_a_scan_that_carries_the_tapes():
    """`tape_scan`'s custom backward pass (tapes read off the final ones) against JAX's own
    differentiation of a plain scan with the tapes in its carry, on a step that attends over the
    positions written so far, with a bool mask among its constants and padding flags."""
    L, B, D = 5, 2, 3
    rng = np.random.default_rng(0)
    weight, start, xs = (jnp.asarray(rng.normal(size=shape)) for shape in [(D, D), (B, D), (L, B, D)])
    # a constant with no gradient
    keep = jnp.asarray([True, False, True])
    real = jnp.asarray(np.arange(L)[:, None] < np.array([5, 3]))  # [L, B]: the second row is padded

    def step(consts, carry, tape, x, flag, t):
        weight, keep = consts
        seen = jnp.arange(L) < t
        scores = jnp.where(seen, jnp.einsum("BLD,BD->BL", tape, carry), -1e9)
        read = jnp.einsum("BL,BLD->BD", jnp.where(seen, jax.nn.softmax(scores), 0.0), tape)
        new = jnp.tanh((x + read + carry) @ weight) * keep
        new = jnp.where(flag[:, None], new, 0.0)
        return jnp.where(flag[:, None], new, carry), new, jnp.sum(new**2, -1)

    def plain(weight, start, xs):
        def body(state, inputs):
            carry, tape = state
            t, x, flag = inputs
            carry, writes, y = step((weight, keep), carry, tape, x, flag, t)
            return (carry, write_at(tape, t, writes)), y

        (carry, tape), ys = jax.lax.scan(body, (start, jnp.zeros((B, L, D))), (jnp.arange(L), xs, real))
        return jnp.sum(carry) + jnp.sum(jnp.sin(tape)) + jnp.sum(ys * jnp.arange(1, L + 1)[:, None])

    def taped(weight, start, xs):
        carry, tape, ys = tape_scan(step, (weight, keep), start, jnp.zeros((B, L, D)), xs, real)
        return jnp.sum(carry) + jnp.sum(jnp.sin(tape)) + jnp.sum(ys * jnp.arange(1, L + 1)[:, None])

    with jax.enable_x64():
        arguments = tuple(a.astype(jnp.float64) for a in (weight, start, xs))
        np.testing.assert_allclose(taped(*arguments), plain(*arguments), rtol=1e-12)
        for ours, reference in zip(jax.grad(taped, (0, 1, 2))(*arguments), jax.grad(plain, (0, 1, 2))(*arguments)):
            np.testing.assert_allclose(ours, reference, rtol=1e-10, atol=1e-12)


def test_bad_fields_are_named():
    with pytest.raises(ConfigError, match="model.fusion must be one of shallow, deep"):
        make(fusion="medium")
    with pytest.raises(ConfigError, match="model.inter_query must be one of previous_state, word_and_context or None"):
        make(inter_query="decoder")
    with pytest.raises(ConfigError, match="deep fusion's is eq. 11's"):
        make(fusion="deep", inter_query="previous_state")
    with pytest.raises(ConfigError, match=r"num_encoder_layers \(2\) must equal num_decoder_layers \(1\)"):
        make(seed_tapes=True, num_encoder_layers=2)
    # each fusion's own
    assert (make().config.query, make(fusion="deep").config.query) == ("previous_state", "word_and_context")
    with pytest.raises(ConfigError, match="bucket"):
        make()(dict(batch_of(), inputs_segment_ids=jnp.ones((3, 7), jnp.int32)))


def test_length_experiment_trains_every_variant_under_one_budget():
    """benchmarks/length_experiment.py --lstmn_variants=all: one column per variant, each the family's
    config with the variant's model fields alone changed, each parsed into the model it names."""
    from benchmarks import length_experiment
    from run_setup.settings import parse

    runs = length_experiment.columns(["rnnsearch", "lstmn"], "all")
    assert list(runs) == ["rnnsearch"] + [f"lstmn_{name}" for name in length_experiment.LSTMN_VARIANTS]
    configs = {
        column: length_experiment.experiment_config(family, "copy", 7, "data/tfds", fields)
        for column, (family, fields) in runs.items()
    }
    expected = {  # (fusion, query, seed_tapes) by column
        "lstmn_shallow_state": ("shallow", "previous_state", False),
        "lstmn_shallow_word_context": ("shallow", "word_and_context", False),
        "lstmn_deep": ("deep", "word_and_context", False),
        "lstmn_shallow_state_seeded": ("shallow", "previous_state", True),
        "lstmn_shallow_word_context_seeded": ("shallow", "word_and_context", True),
        "lstmn_deep_seeded": ("deep", "word_and_context", True),
    }
    for column, variant in expected.items():
        model = parse(configs[column]).model.hyperparameters
        assert (model.fusion, model.query, model.seed_tapes) == variant, column
        others = {k: v for k, v in configs[column].to_dict().items() if k != "model"}
        assert others == {k: v for k, v in configs["lstmn_shallow_state"].to_dict().items() if k != "model"}
    assert {str(c.num_train_steps) + c.schedule for c in configs.values()} == {"7cosine"}
    with pytest.raises(SystemExit, match="unknown shallow; valid: all, shallow_state"):
        length_experiment.columns(["lstmn"], "shallow")


def test_a_run_saved_before_inter_query_existed_reads_as_word_and_context():
    """A config.json written before `model.inter_query` (eq. 11 in both fusions then) restores into the
    model it trained, not into the new shallow default; a saved `inter_query` is kept."""
    import ml_collections

    from configs import base

    old = base.get_config()
    old.model = base.model("lstmn")
    del old.model["inter_query"]
    assert base.with_defaults(old).model.inter_query == "word_and_context"
    new = base.get_config()
    new.model = base.model("lstmn")
    assert base.with_defaults(ml_collections.ConfigDict(new.to_dict())).model.inter_query is None
    assert make().config.query == "previous_state"


def test_a_run_folder_naming_the_query_eq13_reads_as_word_and_context_and_resumes(tmp_path):
    """A run's config.json may say `inter_query="eq13"`, the value's old name: it reads back as
    "word_and_context", and the run resumes under the new name (the resume check compares what
    config.json reads back as); a new config naming "eq13" is refused, naming the valid values."""
    from configs import base
    from run_setup.compatibility import check_resume
    from run_setup.settings import parse, write_run_config

    config = base.get_config()
    config.model = base.model("lstmn", fusion="deep", inter_query="word_and_context")
    write_run_config(parse(config), tmp_path)
    saved = tmp_path / "config.json"
    assert saved.read_text().count('"inter_query": "word_and_context"') == 1
    saved.write_text(saved.read_text().replace('"inter_query": "word_and_context"', '"inter_query": "eq13"'))
    assert base.read_run_config(tmp_path).model.inter_query == "word_and_context"
    # a changed model field would stop here (ConfigError)
    check_resume(parse(config), tmp_path)
    with pytest.raises(ConfigError, match="inter_query must be one of previous_state, word_and_context"):
        make(inter_query="eq13")
