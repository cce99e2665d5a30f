"""Greedy and beam search: hand-built cases, equivalences, the length penalty, batching."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from scoring import decoding
from tasks.vocabularies import BOS_ID, EOS_ID

# the two word tokens of the hand-built model
A, B = 3, 4


class MarkovModel:
    """A hand-built model: the next-token distribution depends only on the previous token.

    From bos: a 0.6, b 0.4. After a: eos 0.5, a 0.25, b 0.25. After b: eos 0.9, a 0.05, b 0.05.
    Greedy takes a, then eos: P = 0.30. The best sequence is b, eos: P = 0.36.
    """

    table = {BOS_ID: {A: 0.6, B: 0.4}, A: {EOS_ID: 0.5, A: 0.25, B: 0.25}, B: {EOS_ID: 0.9, A: 0.05, B: 0.05}}

    def __init__(self, vocab=5, logits=None):
        """The table's logits over `vocab` tokens, or `logits [V, V]` (previous token, next token)."""
        if logits is None:
            logits = np.full((vocab, vocab), -30.0)
            for previous, following in self.table.items():
                for token, p in following.items():
                    logits[previous, token] = math.log(p)
        self.logits = jnp.asarray(logits, jnp.float32)

    def encode(self, inputs):
        return inputs

    def init_decode_state(self, memory, batch_size, max_len):
        # nothing to remember; shaped like a per-row state
        return jnp.zeros((batch_size,), jnp.int32)

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


class RandomMarkovModel(MarkovModel):
    """Next-token logits drawn at random for each previous token; eos made unlikely so that
    many hypotheses run to the length cap."""

    def __init__(self, seed: int, vocab: int = 5, eos_logit: float = -3.0):
        logits = np.random.default_rng(seed).normal(scale=2.0, size=(vocab, vocab))
        logits[:, EOS_ID] += eos_logit
        self.logits = jnp.asarray(logits, jnp.float32)


def exhaustive(model, cap: int, alpha: float) -> list[tuple[float, tuple[int, ...]]]:
    """Every hypothesis of word tokens (3, 4) ending in eos within `cap` tokens, scored
    `log P / lp(|Y|)` with the model's full softmax (float64), best first."""
    log_probs = np.asarray(model.logits, np.float64)
    log_probs = log_probs - np.log(np.exp(log_probs).sum(-1, keepdims=True))
    scored = []
    for length in range(1, cap + 1):
        for words in itertools.product((3, 4), repeat=length - 1):
            sequence = (*words, EOS_ID)
            total = sum(log_probs[previous, token] for previous, token in zip((BOS_ID, *sequence), sequence))
            scored.append((total / ((5 + length) / 6) ** alpha, sequence))
    return sorted(scored, reverse=True)


def test_beam_search_is_exhaustive_search_when_wide_enough_and_pays_for_the_forced_eos():
    """30 random Markov models, cap 5, alpha 1: a beam of 32 (wider than the vocabulary, and than
    the 16 live prefixes) holds every hypothesis, so its best and its n-best list must be the
    exhaustive search's, with scores that include the forced eos's real log-probability."""
    cap, capped_best = 5, 0

    # the logits an argument: one compiled search for the 30 models (each model's own, eager, compiled
    # its own while loop)
    @jax.jit
    def search(logits):
        return decoding.beam_search_n_best(
            MarkovModel(logits=logits),
            jnp.ones((1, 3), jnp.int32),
            jnp.array([cap]),
            cap,
            beam_size=32,
            alpha=1.0,
            num_hypotheses=5,
        )

    for seed in range(30):
        model = RandomMarkovModel(seed)
        tokens, scores = search(model.logits)
        every = exhaustive(model, cap, alpha=1.0)
        score_of = {sequence: score for score, sequence in every}
        found = [tuple(int(t) for t in row[: int(np.argmax(row == EOS_ID)) + 1]) for row in np.asarray(tokens[0])]
        # the best (no ties among the bests of these seeds)
        assert found[0] == every[0][1], seed
        # the n-best list: the exhaustive top 5 scores, each belonging to the hypothesis it came with
        # (Markov models tie on reorderings of the same transitions, so the order of ties is free)
        np.testing.assert_allclose(scores[0], [score for score, _ in every[:5]], rtol=1e-5)
        np.testing.assert_allclose(scores[0], [score_of[sequence] for sequence in found], rtol=1e-5)
        assert len(set(found)) == 5
        capped_best += len(every[0][1]) == cap
    # the cap is reached by the best hypothesis often enough to matter
    assert capped_best >= 5


class PrefixModel:
    """A hand-built model whose next-token distribution depends on the whole prefix (a table per
    prefix of word tokens a, b; a prefix not in the table gets `DEFAULT`). The state is the
    prefix's node in the tree of prefixes; any other token (eos, pad) leads to a sink node."""

    TABLE = {
        (): {EOS_ID: 0.30, A: 0.41, B: 0.29},
        (A,): {EOS_ID: 0.10, A: 0.50, B: 0.40},
        (B,): {EOS_ID: 0.99, A: 0.005, B: 0.005},
    }
    DEFAULT = {EOS_ID: 0.5, A: 0.25, B: 0.25}

    def __init__(self, depth: int, vocab: int = 5):
        self.prefixes = [(), *(words for n in range(1, depth + 1) for words in itertools.product((A, B), repeat=n))]
        # 0: before bos
        node = {prefix: index + 1 for index, prefix in enumerate(self.prefixes)}
        sink = len(self.prefixes) + 1
        children = np.full((sink + 1, vocab), sink)
        children[0, BOS_ID] = node[()]
        logits = np.full((sink + 1, vocab), -30.0)
        for prefix in self.prefixes:
            children[node[prefix], [A, B]] = [node.get((*prefix, word), sink) for word in (A, B)]
            for token, log_p in self.log_probs(prefix).items():
                logits[node[prefix], token] = log_p
        self.children, self.logits = jnp.asarray(children, jnp.int32), jnp.asarray(logits, jnp.float32)

    def log_probs(self, prefix: tuple[int, ...]) -> dict[int, float]:
        return {token: math.log(p) for token, p in self.TABLE.get(prefix, self.DEFAULT).items()}

    def encode(self, inputs):
        return inputs

    def init_decode_state(self, memory, batch_size, max_len):
        return jnp.zeros((batch_size,), jnp.int32)

    def decode_step(self, memory, token, state):
        state = self.children[state, token]
        return self.logits[state], state


def textbook_beam(
    model: PrefixModel, cap: int, alpha: float, beam_size: int, candidates: int
) -> tuple[float, tuple[int, ...]]:
    """Beam search in plain Python over `model.log_probs`, keeping the `candidates` best extensions
    per step: those that end are finished (scored `log P / lp(|Y|)`), the `beam_size` best others go
    on. `candidates = beam_size` is the textbook beam (a hypothesis that ends holds a place);
    `2 * beam_size` is `decoding.beam_search`'s. Runs to the cap (for alpha >= 0 the bound by
    which `decoding` stops earlier changes no best). Returns the best `(score, tokens)`."""
    live, finished = [(0.0, ())], []
    for step in range(cap):
        extensions = []
        for log_p, prefix in live:
            for token, gained in model.log_probs(prefix).items():
                # at the cap only eos, at its real log-probability
                if step + 1 < cap or token == EOS_ID:
                    extensions.append((log_p + gained, (*prefix, token)))
        best = sorted(extensions, reverse=True)[:candidates]
        finished += [(log_p / ((5 + step + 1) / 6) ** alpha, tokens) for log_p, tokens in best if tokens[-1] == EOS_ID]
        live = [(log_p, tokens) for log_p, tokens in best if tokens[-1] != EOS_ID][:beam_size]
    return max(finished)


def prefix_model_exhaustive(model: PrefixModel, cap: int, alpha: float) -> list[tuple[float, tuple[int, ...]]]:
    """Every hypothesis of word tokens ending in eos within `cap` tokens, scored `log P / lp(|Y|)`, best first."""
    scored = []
    for length in range(1, cap + 1):
        for words in itertools.product((A, B), repeat=length - 1):
            sequence = (*words, EOS_ID)
            log_p = sum(model.log_probs(sequence[:i])[token] for i, token in enumerate(sequence))
            scored.append((log_p / ((5 + length) / 6) ** alpha, sequence))
    return sorted(scored, reverse=True)


def test_two_k_candidates_keep_a_finished_hypothesis_from_crowding_out_a_live_one():
    """K = 2, alpha = 1 (lp(1) = 1, lp(2) = 7/6, lp(3) = 4/3), cap 3 tokens, PrefixModel's table.

    Step 1, from bos: a 0.41, eos 0.30, b 0.29.
      textbook (2 candidates): a and eos; eos is finished, log 0.30 / 1 = -1.204, and b, third, is
        dropped: only a goes on.
      2K (4 candidates): a, eos, b; eos is finished, a and b go on.
    Step 2:
      textbook, a's extensions: a a 0.205, a b 0.164 (a eos 0.041 is third, dropped). Step 3 ends them
        at the cap (eos 0.5): a a eos log 0.1025 / (4/3) = -1.708, a b eos log 0.082 / (4/3) = -1.876.
        Best: eos, -1.204.
      2K, a's and b's extensions: b eos 0.29 * 0.99 = 0.2871, a a 0.205, a b 0.164, a eos 0.041.
        b eos is finished, log 0.2871 / (7/6) = -1.070, above eos's -1.204; no live hypothesis can beat
        it (a a: log 0.205 / lp(3) = -1.189 at best), so the search stops. Best: b eos, -1.070.
    Exhaustively, b eos is the best of the 7 hypotheses: the finished eos crowded out the live b that
    leads to it. (With alpha = 0 b's continuations could not beat eos, which outranked b; the length
    penalty lets the longer hypothesis win.)"""
    cap, alpha, beam_size = 3, 1.0, 2
    model = PrefixModel(depth=cap - 1)
    every = prefix_model_exhaustive(model, cap, alpha)
    assert every[0][1] == (B, EOS_ID) and every[0][0] == pytest.approx(math.log(0.29 * 0.99) / (7 / 6))

    tokens, scores = decoding.beam_search(
        model, jnp.ones((1, 3), jnp.int32), jnp.array([cap]), cap, beam_size=beam_size, alpha=alpha
    )
    row = np.asarray(tokens[0])
    assert tuple(int(t) for t in row[: int(np.argmax(row == EOS_ID)) + 1]) == every[0][1]
    assert float(scores[0]) == pytest.approx(every[0][0], rel=1e-5)
    # the plain-Python beam with 2K candidates is decoding's; with K, the textbook beam, it finds eos alone
    assert textbook_beam(model, cap, alpha, beam_size, candidates=2 * beam_size)[1] == every[0][1]
    textbook_score, textbook_tokens = textbook_beam(model, cap, alpha, beam_size, candidates=beam_size)
    assert textbook_tokens == (EOS_ID,)
    assert textbook_score == pytest.approx(math.log(0.30)) and textbook_score < every[0][0] - 0.1


def test_scores_are_teacher_forced_log_probabilities_over_the_length_penalty():
    model = RandomMarkovModel(3)
    inputs = jnp.ones((1, 3), jnp.int32)
    for search in ("greedy", "beam"):
        if search == "greedy":
            tokens, scores = decoding.greedy_search(model, inputs, jnp.array([4]), 4)
            penalty = lambda length: 1.0  # noqa: E731  (greedy returns log P itself)
        else:
            tokens, scores = decoding.beam_search(model, inputs, jnp.array([4]), 4, beam_size=3, alpha=0.6)
            penalty = lambda length: ((5 + length) / 6) ** 0.6  # noqa: E731
        row = np.asarray(tokens[0])
        sequence = row[: int(np.argmax(row == EOS_ID)) + 1]
        log_probs = np.asarray(jax.nn.log_softmax(model.logits))
        total = sum(log_probs[p, t] for p, t in zip([BOS_ID, *sequence[:-1]], sequence))
        assert float(scores[0]) == pytest.approx(total / penalty(len(sequence)), rel=1e-5)


def test_sampling_follows_the_model_and_its_filters():
    # from bos: a 0.6, b 0.4
    model = MarkovModel()
    inputs = jnp.ones((4000, 1), jnp.int32)
    tokens, scores = decoding.sample(model, inputs, jnp.full((4000,), 3), 3, key=jax.random.key(0))
    first = np.asarray(tokens[:, 0])
    # 4000 draws: standard error 0.008
    assert abs((first == A).mean() - 0.6) < 0.03
    log_probs = np.asarray(jax.nn.log_softmax(model.logits))
    # the score is the sample's log-probability under the model
    for row in range(5):
        sequence = np.asarray(tokens[row])[: int(np.argmax(np.asarray(tokens[row]) == EOS_ID)) + 1]
        total = sum(log_probs[p, t] for p, t in zip([BOS_ID, *sequence[:-1]], sequence))
        assert float(scores[row]) == pytest.approx(total, rel=1e-5)
    greedy = decoding.greedy_search(model, inputs[:8], jnp.full((8,), 3), 3)[0]
    # each leaves only the most likely token
    for filters in (dict(top_k=1), dict(top_p=0.5), dict(temperature=1e-3)):
        sampled = decoding.sample(model, inputs[:8], jnp.full((8,), 3), 3, key=jax.random.key(1), **filters)[0]
        np.testing.assert_array_equal(sampled, greedy)


def test_nucleus_filter_keeps_the_smallest_set_reaching_top_p():
    log_probs = jnp.log(jnp.array([[0.05, 0.5, 0.3, 0.15]]))
    kept = np.asarray(decoding.filtered_log_probs(log_probs, 1.0, 0, 0.75)) > decoding.NEVER / 2
    # 0.5 + 0.3 >= 0.75
    np.testing.assert_array_equal(kept, [[False, True, True, False]])
    kept = np.asarray(decoding.filtered_log_probs(log_probs, 1.0, 2, 1.0)) > decoding.NEVER / 2
    # top 2
    np.testing.assert_array_equal(kept, [[False, True, True, False]])


@pytest.mark.parametrize("size,k", [(1000, 8), (130, 3), (64, 8), (7, 2)])
def test_top_k_by_chunks_equals_the_library_s_ties_included(size, k):
    """Many ties (values from a few integers, and -inf as never-allowed tokens): the same values and
    the same indices, ties to the lower index, also where the row is not a whole number of chunks."""
    rng = np.random.default_rng(size)
    x = rng.integers(-3, 3, size=(5, size)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[0] = 1.0  # a row of one value
    values, indices = decoding.top_k(jnp.asarray(x), k, width=16)
    # a stable sort keeps equal values in index order
    expected_indices = np.argsort(-x, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(indices, expected_indices)
    np.testing.assert_array_equal(values, np.take_along_axis(x, expected_indices, axis=1))
    np.testing.assert_array_equal(indices, jax.lax.top_k(jnp.asarray(x), k)[1])
    np.testing.assert_array_equal(indices[0], np.arange(k))


def test_top_k_by_chunks_breaks_a_tie_between_chunks_by_index_not_by_chunk_rank():
    # chunks of 4: the 2 at index 0 (chunk of max 3) comes before the 2 at index 5 (chunk of max 5)
    x = jnp.array([[2.0, 3.0, 0.0, 0.0, 5.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0]])
    values, indices = decoding.top_k(x, 3, width=4)
    np.testing.assert_array_equal(values, [[5.0, 3.0, 2.0]])
    np.testing.assert_array_equal(indices, [[4, 1, 0]])


def test_first_max_index_is_numpy_s_argmax_ties_infinities_and_nans_included():
    """Rows of many ties (a few integers), of -inf only, with +inf, and with NaNs (argmax names the
    first NaN, as NumPy's does): the same index as `np.argmax`, under jit as the searches run it."""
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(8, 8000)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[1] = -np.inf
    x[2, [5, 70]] = np.inf
    x[3, [9, 4000]] = np.nan
    x[4, 7999] = 5.0  # the last column
    expected = np.argmax(x, axis=-1)
    np.testing.assert_array_equal(jax.jit(decoding.first_max_index)(jnp.asarray(x)), expected)
    assert list(expected[1:5]) == [0, 5, 9, 7999]


def test_length_penalty_formula():
    assert float(decoding.length_penalty(1.0, 0.6)) == pytest.approx(1.0)
    assert float(decoding.length_penalty(7.0, 1.0)) == pytest.approx(2.0)
    assert float(decoding.length_penalty(10.0, 0.6)) == pytest.approx((15 / 6) ** 0.6)
    assert float(decoding.length_penalty(10.0, 0.0)) == 1.0


# ------------------------------------------------------------ with the Transformer


@pytest.fixture(scope="module")
def transformer():
    return models.create_model(
        "transformer",
        rngs=nnx.Rngs(3),
        vocab_size=12,
        d_model=32,
        num_heads=4,
        d_ff=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.0,
    )


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


def test_beam_search_leaves_the_output_table_in_place_where_its_rows_match_the_hypotheses(transformer):
    """8 sources x 4 beams = 32 rows = d_model: a `[D, V]` table outside `Unreordered` would have its
    rows reordered with the hypotheses; it stays the embedding transposed."""
    memory = transformer.encode(jnp.ones((8, 5), jnp.int32))
    state = transformer.init_decode_state(memory, 32, 6)
    origins = jnp.tile(jnp.array([3, 3, 0, 1]), (8, 1))
    reordered = decoding.reorder_hypotheses(state, origins)
    table = np.asarray(transformer.target_embed.embedding.embedding[...]).T
    assert reordered.output_table.arrays.shape[0] == 32
    np.testing.assert_array_equal(reordered.output_table.arrays, table)
    # the slot tables do follow the beams
    np.testing.assert_array_equal(
        reordered.caches[0].origins[:, :, 0], np.asarray(state.caches[0].origins)[:, [3, 3, 0, 1], 0]
    )


@pytest.mark.parametrize(
    "search,kwargs", [(decoding.greedy_search, {}), (decoding.beam_search, {"beam_size": 3, "alpha": 0.6})]
)
def test_cached_decoding_equals_uncached(transformer, sources, search, kwargs):
    cached_tokens, cached_scores = run(search, transformer, sources, **kwargs)
    uncached_tokens, uncached_scores = run(search, decoding.WithoutCache(transformer), sources, **kwargs)
    np.testing.assert_array_equal(cached_tokens, uncached_tokens)
    np.testing.assert_allclose(cached_scores, uncached_scores, rtol=1e-4, atol=1e-5)


FAMILIES = {
    "transformer": dict(d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0),
    "rnnencdec": dict(embed_dim=8, hidden_dim=16, maxout_dim=8),
    "rnnsearch": dict(embed_dim=8, hidden_dim=16, maxout_dim=8, attention_dim=16),
    "luong": dict(embed_dim=8, hidden_dim=16, num_encoder_layers=1, num_decoder_layers=1),
    "lstmn": dict(embed_dim=8, hidden_dim=16, attention_dim=16, fusion="deep"),
}


@nnx.jit
def teacher_forced(model, inputs, tokens):
    """The model's logits `[B, T, V]` of `tokens` given `inputs`, compiled once per model and shapes
    (op by op, each call of a recurrent family's scan compiled again)."""
    return model({"inputs": inputs, "targets": tokens})


def sequence_log_probs(model, inputs, tokens):
    """Teacher-forced `log P(tokens | inputs)` per row, eos included: `[B]`."""
    log_probs = np.asarray(jax.nn.log_softmax(teacher_forced(model, inputs, tokens)), np.float64)
    picked = np.take_along_axis(log_probs, np.asarray(tokens)[..., None], axis=-1)[..., 0]
    return np.where(np.asarray(tokens) != 0, picked, 0.0).sum(-1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_search_on_every_family(family, sources):
    """A beam of one is greedy search; beam search scores are teacher-forced log-probabilities over
    the length penalty; a padded batch decodes as each example alone; sampling's scores are its
    samples' log-probabilities (every family)."""
    model = models.create_model(family, rngs=nnx.Rngs(3), vocab_size=12, **FAMILIES[family])
    greedy_tokens, greedy_scores = run(decoding.greedy_search, model, sources)
    beam1_tokens, beam1_scores = run(decoding.beam_search, model, sources, beam_size=1, alpha=0.6)
    lengths = np.argmax(np.asarray(greedy_tokens) == EOS_ID, axis=1) + 1
    np.testing.assert_array_equal(beam1_tokens, greedy_tokens)
    np.testing.assert_allclose(beam1_scores, np.asarray(greedy_scores) / ((5 + lengths) / 6) ** 0.6, rtol=1e-5)
    np.testing.assert_allclose(greedy_scores, sequence_log_probs(model, sources, greedy_tokens), rtol=1e-4, atol=1e-4)

    tokens, scores = run(decoding.beam_search, model, sources, beam_size=4, alpha=0.6)
    lengths = np.argmax(np.asarray(tokens) == EOS_ID, axis=1) + 1
    teacher_forced = sequence_log_probs(model, sources, tokens) / ((5 + lengths) / 6) ** 0.6
    np.testing.assert_allclose(scores, teacher_forced, rtol=1e-4, atol=1e-4)
    # the wider beam finds no worse
    assert np.all(np.asarray(scores) >= np.asarray(beam1_scores) - 1e-5)
    sampled, sampled_scores = run(decoding.sample, model, sources, key=jax.random.key(0), temperature=0.8, top_p=0.9)
    np.testing.assert_allclose(sampled_scores, sequence_log_probs(model, sources, sampled), rtol=1e-4, atol=1e-4)
    for row in range(3):
        length = int((sources[row] > 0).sum())
        alone_tokens, alone_scores = run(
            decoding.beam_search, model, sources[row : row + 1, :length], beam_size=4, alpha=0.6
        )
        np.testing.assert_array_equal(alone_tokens[0], tokens[row])
        np.testing.assert_allclose(alone_scores[0], scores[row], rtol=1e-4, atol=1e-5)
