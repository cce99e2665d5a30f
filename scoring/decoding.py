"""Greedy search, beam search and sampling over the common decoding interface
(`encode`, `init_decode_state`, `decode_step`): any object that has those three
methods decodes, NNX module or not.

All are compiled with `lax.while_loop` and work on batches. Each row may emit
at most `max_lengths[b]` tokens, eos included (evaluation uses the source
length plus `decode.max_length_offset`; an image has no length: its caption may
take the whole decoded `length`). At a row's last allowed step eos is
the only choice, and it is charged its real log-probability: a hypothesis cut
at the cap pays for ending there, as one that ends on its own does. Pad and
bos are never produced. Rows are independent: a padded batch searches as each
example alone would (sampling draws per row, so its samples depend on the row's place).

Outputs are `[B, L]` ids, each row ending with eos followed by padding, and a
score per row: greedy search and sampling return `log P(Y)`, beam search
`log P(Y) / lp(|Y|)` with the length penalty of Wu et al. (2016); `|Y|`
counts the eos.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from models.attention import hypothesis_rows
from models.interface import TeacherForcedDecoder
from tasks.vocabularies import BOS_ID, EOS_ID, PAD_ID, UNK_ID

Array = jax.Array
# log-probability of what may not be chosen (finite: see models/attention.py)
NEVER = -1e9
# decode.method: greedy/beam search, or sampling
METHODS = ("search", "sample")


def source_lengths(inputs: Array) -> Array:
    """Non-padding tokens per row: `[B, S] -> [B]`."""
    return jnp.sum(inputs != PAD_ID, axis=-1)


def next_token_log_probs(logits: Array, step: Array, max_lengths: Array) -> Array:
    """The model's log-softmax over the tokens allowed next, NEVER elsewhere.

    Pad and bos are never allowed; at each row's last allowed step only eos is,
    with its real log-probability (not 0: a forced end is not free).

    Args:
      logits: `[R, V]`.  step: the position being produced.  max_lengths: `[R]`.
    Returns:
      `[R, V]` float32.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    vocab = jnp.arange(log_probs.shape[-1])
    last = (step + 1 >= max_lengths)[:, None]  # [R, 1]
    allowed = (vocab != PAD_ID) & (vocab != BOS_ID) & (~last | (vocab == EOS_ID))  # [R, V]
    return jnp.where(allowed, log_probs, NEVER)


Chooser = Callable[[Array, Array], Array]  # (allowed log-probabilities [B, V], step) -> tokens [B]


def one_per_row(model: Any, inputs: Array, max_lengths: Array, length: int, choose: Chooser) -> tuple[Array, Array]:
    """Decodes one hypothesis per row, taking at each step the token `choose` picks.

    Returns:
      `(tokens [B, length], log-probability of each row's tokens under the model [B])`.
    """
    batch = inputs.shape[0]
    memory = model.encode(inputs)
    state = model.init_decode_state(memory, batch, length)
    max_lengths = jnp.minimum(max_lengths, length)

    def not_finished(carry) -> Array:
        step, _, _, _, _, done = carry
        return (step < length) & ~jnp.all(done)

    def step_once(carry):
        step, previous, state, tokens, scores, done = carry
        logits, state = model.decode_step(memory, previous, state)
        log_probs = next_token_log_probs(logits, step, max_lengths)
        chosen = choose(log_probs, step).astype(jnp.int32)
        gained = jnp.take_along_axis(log_probs, chosen[:, None], axis=-1)[:, 0]
        chosen = jnp.where(done, PAD_ID, chosen)
        scores = scores + jnp.where(done, 0.0, gained)
        tokens = tokens.at[:, step].set(chosen)
        return step + 1, chosen, state, tokens, scores, done | (chosen == EOS_ID)

    start = (
        0,
        jnp.full((batch,), BOS_ID, jnp.int32),
        state,
        jnp.zeros((batch, length), jnp.int32),
        jnp.zeros(batch),
        jnp.zeros(batch, bool),
    )
    _, _, _, tokens, scores, _ = jax.lax.while_loop(not_finished, step_once, start)
    return tokens, scores


def greedy_search(model: Any, inputs: Array, max_lengths: Array, length: int) -> tuple[Array, Array]:
    """The most likely next token at every step.

    Args:
      inputs: `[B, S]` source ids (or images: anything the model's `encode` reads).
      max_lengths: `[B]` tokens allowed per row (<= length).  length: static size of the output buffer.
    Returns:
      `(tokens [B, length], log P(tokens) [B])`.
    """
    return one_per_row(model, inputs, max_lengths, length, lambda log_probs, step: first_max_index(log_probs))


def first_max_index(x: Array) -> Array:
    """`jnp.argmax(x, axis=-1)` of `x [R, V]` (the first maximum of a row, or its first NaN) from two
    plain reductions: `[R] int32`. XLA:CPU runs argmax's variadic reduce apart and 4-5x slower: 143
    against 31 us a greedy step at 8 x 8000 (docs/performance.md, "Against the strongest peers").
    """
    if x.shape[-1] > 2**24:
        # float32 counts exactly up to 2^24
        return jnp.argmax(x, axis=-1)
    # NaN where the row has one: then its NaNs are the hits, as argmax's
    peak = jnp.max(x, axis=-1, keepdims=True)
    hits = (x == peak) | jnp.isnan(x)
    index = jax.lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hits, index, jnp.inf), axis=-1).astype(jnp.int32)


def filtered_log_probs(log_probs: Array, temperature: float, top_k: int, top_p: float) -> Array:
    """The sampling distribution: `log_probs / temperature`, restricted to the `top_k` most likely
    tokens (0: all) and to the smallest set whose probability reaches `top_p` (Holtzman et al.
    2020; 1: all). Unnormalised; NEVER outside."""
    scaled = jnp.where(log_probs > NEVER / 2, log_probs / temperature, NEVER)
    if 0 < top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]  # [R, 1]
        scaled = jnp.where(scaled >= kth, scaled, NEVER)
    if top_p < 1.0:
        order = jnp.argsort(-scaled, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
        # mass of the more likely tokens
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # the most likely token is always kept
        keep_sorted = before < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(len(order))[:, None], order].set(keep_sorted)
        scaled = jnp.where(keep, scaled, NEVER)
    return scaled


def sample(
    model: Any,
    inputs: Array,
    max_lengths: Array,
    length: int,
    *,
    key: Array,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[Array, Array]:
    """Ancestral sampling, one hypothesis per row, from the filtered distribution (`filtered_log_probs`).

    Returns:
      `(tokens [B, length], log P(tokens) [B] under the model itself, not the filtered distribution)`.
    """

    def choose(log_probs: Array, step: Array) -> Array:
        return jax.random.categorical(
            jax.random.fold_in(key, step), filtered_log_probs(log_probs, temperature, top_k, top_p)
        )

    return one_per_row(model, inputs, max_lengths, length, choose)


def top_k(x: Array, k: int, *, width: int = 64) -> tuple[Array, Array]:
    """`jax.lax.top_k(x, k)` over the last axis of `x [R, N]` without NaN: the same values and indices,
    ties to the lower index, found in the k chunks of `width` whose maxima are the largest (each of the k
    largest lies in one of them). One pass of maxima and two small top_k's: XLA:CPU's top_k over
    beam search's `K V` candidates of a row took about a tenth of a decoding step, this a third of
    that (the peers benchmark's model).

    Returns:
      `(values [R, k], indices [R, k])`.
    """
    rows, size = x.shape
    if k * width >= size:
        return jax.lax.top_k(x, k)
    chunks = jnp.pad(x, ((0, 0), (0, -size % width)), constant_values=-jnp.inf).reshape(rows, -1, width)
    # in index order, so that the last top_k breaks ties as one over the whole row would
    best = jnp.sort(jax.lax.top_k(chunks.max(axis=-1), k)[1], axis=-1)  # [R, k]
    candidates = jnp.take_along_axis(chunks, best[:, :, None], axis=1).reshape(rows, k * width)
    values, where = jax.lax.top_k(candidates, k)
    return values, jnp.take_along_axis(best, where // width, axis=1) * width + where % width


def length_penalty(length: Array, alpha: float) -> Array:
    """Wu et al. (2016) eq. 14: `lp(Y) = (5 + |Y|)^alpha / (5 + 1)^alpha`."""
    return ((5.0 + length) / 6.0) ** alpha


class Beams(NamedTuple):
    # the position being produced
    step: Array
    live_tokens: Array  # [B, K, L]
    live_log_probs: Array  # [B, K]; NEVER for empty slots
    finished_tokens: Array  # [B, K, L]
    finished_scores: Array  # [B, K] length-normalised; NEVER for empty slots
    # the model's decode state, rows [B*K]
    state: Any


def reorder_hypotheses(tree: Any, origins: Array) -> Any:
    """The decode state after beam search's choice: hypothesis k of source b continues hypothesis
    `origins[b, k]` (`[B, K]`). A node that knows how (`reorder_hypotheses`: the source's arrays,
    which stay, and the Transformer's caches, which move only their slot tables) does it itself;
    every other array has its `[B*K, ...]` rows reordered."""
    rows = hypothesis_rows(origins)

    def reorder(x):
        if hasattr(x, "reorder_hypotheses"):
            return x.reorder_hypotheses(origins)
        # scalars (a step count) stay
        return x[rows] if x.ndim and x.shape[0] == rows.shape[0] else x

    return jax.tree.map(reorder, tree, is_leaf=lambda x: hasattr(x, "reorder_hypotheses"))


def memory_for_hypotheses(model: Any, memory: Any, hypotheses: int) -> Any:
    """The memory as `model`'s decode steps read it for `hypotheses` consecutive rows per source:
    one row per source where the model takes it so (`memory_per_source`), else each row repeated."""
    if getattr(model, "memory_per_source", False):
        return memory
    return jax.tree.map(lambda x: jnp.repeat(x, hypotheses, axis=0), memory)


def beam_search_n_best(
    model: Any, inputs: Array, max_lengths: Array, length: int, *, beam_size: int, alpha: float, num_hypotheses: int
) -> tuple[Array, Array]:
    """Beam search with the length penalty of Wu et al. (2016); the `num_hypotheses` best per row.

    Every step extends the `K` live beams by every token (`K V` extensions), keeps the
    `min(2K, K V)` best by log-probability, moves those ending in eos to the finished set
    (the `K` best finished so far, scored `log P / lp(|Y|)`, kept once final) and keeps the
    `K` best others live.

    2K candidates, not K. The textbook beam keeps the `K` best of the `K V` extensions,
    and a hypothesis that ends holds one of those `K` places: a step whose `K` best
    include `j` that end goes on with `K - j` live hypotheses, one whose `K` best all
    end stops the search, and the live extensions ranked just below the finished ones
    are dropped although they may lead to a better-scoring hypothesis (finished
    hypotheses crowd out live ones). Each live beam has one eos extension, so at most
    `K` of the `2K` best end: the `K` best that do not end stay live (when `K` tokens
    other than eos are allowed), every step goes on with `K` live beams, and a
    hypothesis that ends ranked `K+1..2K` still enters the finished set. This is
    tensor2tensor's practice (tensor2tensor/utils/beam_search.py, `grow_topk`:
    `top_k(..., k=beam_size * 2)`), kept for every model family.
    `test_two_k_candidates_keep_a_finished_hypothesis_from_crowding_out_a_live_one`
    (tests/test_decoding.py) works a case where the textbook beam returns a worse
    hypothesis and this one the best of all.

    The search stops when no live beam can beat the N-th best finished one: for
    `alpha >= 0` a live beam's score can at best become `log P / lp(max_length)`. A beam
    of one is greedy search: its one hypothesis ends when eos is its best continuation.

    Returns:
      `(tokens [B, N, length], scores [B, N])`, best first; a row with fewer than N finished
      hypotheses has score NEVER in the empty slots.
    """
    if not 1 <= num_hypotheses <= beam_size:
        raise ValueError(f"num_hypotheses must be between 1 and the beam size {beam_size}, got {num_hypotheses}")
    if beam_size == 1:
        tokens, log_probs = greedy_search(model, inputs, max_lengths, length)
        lengths = jnp.argmax(tokens == EOS_ID, axis=-1) + 1.0
        return tokens[:, None], (log_probs / length_penalty(lengths, alpha))[:, None]
    batch, beams = inputs.shape[0], beam_size
    max_lengths = jnp.minimum(max_lengths, length)
    memory = memory_for_hypotheses(model, model.encode(inputs), beams)
    state = model.init_decode_state(memory, batch * beams, length)
    start = Beams(
        step=jnp.array(0),
        live_tokens=jnp.zeros((batch, beams, length), jnp.int32),
        # one beam at first
        live_log_probs=jnp.tile(jnp.array([0.0] + [NEVER] * (beams - 1)), (batch, 1)),
        finished_tokens=jnp.zeros((batch, beams, length), jnp.int32),
        finished_scores=jnp.full((batch, beams), NEVER),
        state=state,
    )
    row_limits = jnp.repeat(max_lengths, beams)  # [B*K]

    def can_improve(b: Beams) -> Array:
        best_live = jnp.max(b.live_log_probs, axis=1) / length_penalty(max_lengths, alpha)  # [B]
        # the N-th best finished (sorted; NEVER if none)
        last_kept = b.finished_scores[:, num_hypotheses - 1]
        return (b.step < length) & jnp.any((best_live > last_kept) & (best_live > NEVER / 2))

    def step_once(b: Beams) -> Beams:
        previous = jnp.where(b.step == 0, BOS_ID, b.live_tokens[:, :, jnp.maximum(b.step - 1, 0)]).reshape(-1)
        logits, state = model.decode_step(memory, previous, b.state)
        log_probs = next_token_log_probs(logits, b.step, row_limits).reshape(batch, beams, -1)  # [B, K, V]
        vocab = log_probs.shape[-1]
        candidates = (b.live_log_probs[:, :, None] + log_probs).reshape(batch, beams * vocab)
        # [B, C]; at most K end (docstring)
        top_scores, top_index = top_k(candidates, min(2 * beams, beams * vocab))
        origin, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        # neither an empty slot's extension nor a token never allowed
        valid = top_scores > NEVER / 2
        sequences = jnp.take_along_axis(b.live_tokens, origin[:, :, None], axis=1)  # [B, C, L]
        sequences = sequences.at[:, :, b.step].set(token)
        ends = token == EOS_ID

        live_scores = jnp.where(ends | ~valid, NEVER, top_scores)
        live_scores, keep = jax.lax.top_k(live_scores, beams)  # [B, K]
        live_tokens = jnp.take_along_axis(sequences, keep[:, :, None], axis=1)
        state = reorder_hypotheses(state, jnp.take_along_axis(origin, keep, axis=1))

        new_finished = jnp.where(ends & valid, top_scores / length_penalty(b.step + 1.0, alpha), NEVER)
        pooled_scores = jnp.concatenate([b.finished_scores, new_finished], axis=1)  # [B, K + C]
        pooled_tokens = jnp.concatenate([b.finished_tokens, sequences], axis=1)
        finished_scores, best = jax.lax.top_k(pooled_scores, beams)
        finished_tokens = jnp.take_along_axis(pooled_tokens, best[:, :, None], axis=1)
        return Beams(b.step + 1, live_tokens, live_scores, finished_tokens, finished_scores, state)

    final = jax.lax.while_loop(can_improve, step_once, start)
    # top_k sorted them
    return final.finished_tokens[:, :num_hypotheses], final.finished_scores[:, :num_hypotheses]


def beam_search(
    model: Any, inputs: Array, max_lengths: Array, length: int, *, beam_size: int, alpha: float
) -> tuple[Array, Array]:
    """The best hypothesis of `beam_search_n_best`: `(tokens [B, length], scores [B])`."""
    tokens, scores = beam_search_n_best(
        model, inputs, max_lengths, length, beam_size=beam_size, alpha=alpha, num_hypotheses=1
    )
    return tokens[:, 0], scores[:, 0]


def decode(
    model: Any,
    inputs: Array,
    *,
    length: int,
    max_length_offset: int,
    method: str = "search",
    beam_size: int = 1,
    alpha: float = 0.0,
    num_hypotheses: int = 1,
    key: Array | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[Array, Array]:
    """The configured decoding (`config.decode`): beam search (greedy for a beam of one) or sampling,
    with outputs of at most the source length + `max_length_offset` tokens (token sources `[B, S]`)
    or `length` tokens (images `[B, H, W, C]`, feature grids `[B, L, D]`).

    Returns:
      `(tokens [B, N, L], scores [B, N])` with N = `num_hypotheses` (1 when sampling) and
      L = `min(length, S + max_length_offset)` for token sources, `length` for the others.
    """
    if inputs.ndim == 2:
        max_lengths = source_lengths(inputs) + max_length_offset
        # No output can be longer than the padded source plus the offset: shorter buffers and
        # caches for batches of short sources (their search steps move less memory).
        length = min(length, inputs.shape[1] + max_length_offset)
    else:
        max_lengths = jnp.full(inputs.shape[:1], length, jnp.int32)
    if method == "sample":
        tokens, scores = sample(
            model, inputs, max_lengths, length, key=key, temperature=temperature, top_k=top_k, top_p=top_p
        )
        return tokens[:, None], scores[:, None]
    return beam_search_n_best(
        model, inputs, max_lengths, length, beam_size=beam_size, alpha=alpha, num_hypotheses=num_hypotheses
    )


class WithoutCache:
    """A model's decoding interface without its cache: every step reruns the teacher-forced
    decoder (`model.decode(targets, memory)`) over the whole prefix.

    A reference for cached decoding (same tokens and scores) and a baseline for what the cache saves.
    """

    # unknown future targets: any non-pad token (the causal mask hides them; pad would mask the row)
    FILLER = UNK_ID

    def __init__(self, model: TeacherForcedDecoder):
        if not model.config.has_decode:
            raise ValueError(
                f"{type(model).__name__} declares no teacher-forced decode (config.has_decode); WithoutCache needs one"
            )
        self.model = model

    def encode(self, inputs: Array) -> Any:
        return self.model.encode(inputs)

    def init_decode_state(self, memory: Any, batch_size: int, max_len: int) -> tuple[Array, Array]:
        return jnp.full((batch_size, max_len), self.FILLER, jnp.int32), jnp.array(0)

    def decode_step(self, memory: Any, token: Array, state: tuple[Array, Array]) -> tuple[Array, tuple[Array, Array]]:
        targets, position = state
        targets = jnp.where(position > 0, targets.at[:, jnp.maximum(position - 1, 0)].set(token), targets)
        return self.model.decode(targets, memory)[:, position], (targets, position + 1)
