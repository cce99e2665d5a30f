"""Greedy and beam search over the common decoding interface (`encode`, `init_decode_state`, `decode_step`).

Both are compiled with `lax.while_loop` and work on batches. Each row may emit
at most `max_lengths[b]` tokens (eos included; the trainer uses the source
length plus `decode.max_length_offset`), and eos is forced there. Rows are
independent: a padded batch decodes as each example alone would.

Outputs are `[B, L]` ids, each row ending with eos followed by padding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vocabularies import BOS_ID, EOS_ID, PAD_ID, UNK_ID

Array = jax.Array
NEVER = -1e9  # log-probability of what may not be chosen (finite: see models/attention.py)


def source_lengths(inputs: Array) -> Array:
    """Non-padding tokens per row: `[B, S] -> [B]`."""
    return jnp.sum(inputs != PAD_ID, axis=-1)


def next_token_log_probs(logits: Array, step: Array, max_lengths: Array) -> Array:
    """Log-softmax with pad and bos excluded, and eos forced at each row's last allowed step.

    Args:
      logits: `[R, V]`.  step: the position being produced.  max_lengths: `[R]`.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    log_probs = log_probs.at[:, PAD_ID].set(NEVER).at[:, BOS_ID].set(NEVER)
    last = (step + 1 >= max_lengths)[:, None]  # [R, 1]
    only_eos = jnp.full_like(log_probs, NEVER).at[:, EOS_ID].set(0.0)
    return jnp.where(last, only_eos, log_probs)


def greedy_search(model: Any, inputs: Array, max_lengths: Array, length: int) -> tuple[Array, Array]:
    """The most likely next token at every step.

    Args:
      inputs: `[B, S]` source ids.  max_lengths: `[B]` tokens allowed per row (<= length).
      length: static size of the output buffer.
    Returns:
      `(tokens [B, length], log-probability of each row's tokens [B])`.
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
        chosen = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
        gained = jnp.take_along_axis(log_probs, chosen[:, None], axis=-1)[:, 0]
        chosen = jnp.where(done, PAD_ID, chosen)
        scores = scores + jnp.where(done, 0.0, gained)
        tokens = tokens.at[:, step].set(chosen)
        return step + 1, chosen, state, tokens, scores, done | (chosen == EOS_ID)

    start = (0, jnp.full((batch,), BOS_ID, jnp.int32), state, jnp.zeros((batch, length), jnp.int32), jnp.zeros(batch), jnp.zeros(batch, bool))
    _, _, _, tokens, scores, _ = jax.lax.while_loop(not_finished, step_once, start)
    return tokens, scores


def length_penalty(length: Array, alpha: float) -> Array:
    """Wu et al. (2016) eq. 14: `lp(Y) = (5 + |Y|)^alpha / (5 + 1)^alpha`."""
    return ((5.0 + length) / 6.0) ** alpha


class Beams(NamedTuple):
    step: Array  # the position being produced
    live_tokens: Array  # [B, K, L]
    live_log_probs: Array  # [B, K]; NEVER for empty slots
    finished_tokens: Array  # [B, K, L]
    finished_scores: Array  # [B, K] length-normalised; NEVER for empty slots
    state: Any  # the model's decode state, rows [B*K]


def _gather_beams(tree: Any, origins: Array, batch: int, beams: int) -> Any:
    """Reorders the `[B*K, ...]` rows of every array of `tree` by `origins [B, K]` (beam index per row)."""
    flat = (origins + beams * jnp.arange(batch)[:, None]).reshape(-1)  # [B*K]

    def gather(x):
        return x[flat] if x.ndim and x.shape[0] == batch * beams else x  # scalars (cache index) stay

    return jax.tree.map(gather, tree)


def beam_search(
    model: Any, inputs: Array, max_lengths: Array, length: int, *, beam_size: int, alpha: float
) -> tuple[Array, Array]:
    """Beam search with the length penalty of Wu et al. (2016).

    Every step extends the live beams, keeps the `2K` best candidates, moves
    those ending in eos to the finished set (score `log P / lp(|Y|)`, kept once
    final) and keeps the `K` best others live. The search stops when no live
    beam can beat the best finished one: for `alpha >= 0` a live beam's score
    can at best become `log P / lp(max_length)`.

    Returns:
      `(tokens [B, length], scores [B])` of the best finished hypothesis per row.
    """
    batch, beams = inputs.shape[0], beam_size
    max_lengths = jnp.minimum(max_lengths, length)
    memory = jax.tree.map(lambda x: jnp.repeat(x, beams, axis=0), model.encode(inputs))  # rows [B*K]
    state = model.init_decode_state(memory, batch * beams, length)
    start = Beams(
        step=jnp.array(0),
        live_tokens=jnp.zeros((batch, beams, length), jnp.int32),
        live_log_probs=jnp.tile(jnp.array([0.0] + [NEVER] * (beams - 1)), (batch, 1)),  # one beam at first
        finished_tokens=jnp.zeros((batch, beams, length), jnp.int32),
        finished_scores=jnp.full((batch, beams), NEVER),
        state=state,
    )
    row_limits = jnp.repeat(max_lengths, beams)  # [B*K]

    def can_improve(b: Beams) -> Array:
        best_live = jnp.max(b.live_log_probs, axis=1) / length_penalty(max_lengths, alpha)  # [B]
        best_finished = jnp.max(b.finished_scores, axis=1)
        return (b.step < length) & jnp.any(best_live > best_finished)

    def step_once(b: Beams) -> Beams:
        previous = jnp.where(b.step == 0, BOS_ID, b.live_tokens[:, :, jnp.maximum(b.step - 1, 0)]).reshape(-1)
        logits, state = model.decode_step(memory, previous, b.state)
        log_probs = next_token_log_probs(logits, b.step, row_limits).reshape(batch, beams, -1)  # [B, K, V]
        vocab = log_probs.shape[-1]
        candidates = (b.live_log_probs[:, :, None] + log_probs).reshape(batch, beams * vocab)
        top_scores, top_index = jax.lax.top_k(candidates, 2 * beams)  # [B, 2K]
        origin, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        sequences = jnp.take_along_axis(b.live_tokens, origin[:, :, None], axis=1)  # [B, 2K, L]
        sequences = sequences.at[:, :, b.step].set(token)
        ends = token == EOS_ID

        live_scores = jnp.where(ends, NEVER, top_scores)
        live_scores, keep = jax.lax.top_k(live_scores, beams)  # [B, K]
        live_tokens = jnp.take_along_axis(sequences, keep[:, :, None], axis=1)
        state = _gather_beams(state, jnp.take_along_axis(origin, keep, axis=1), batch, beams)

        new_finished = jnp.where(ends, top_scores / length_penalty(b.step + 1.0, alpha), NEVER)
        new_finished = jnp.where(top_scores > NEVER / 2, new_finished, NEVER)  # extensions of empty slots
        pooled_scores = jnp.concatenate([b.finished_scores, new_finished], axis=1)  # [B, 3K]
        pooled_tokens = jnp.concatenate([b.finished_tokens, sequences], axis=1)
        finished_scores, best = jax.lax.top_k(pooled_scores, beams)
        finished_tokens = jnp.take_along_axis(pooled_tokens, best[:, :, None], axis=1)
        return Beams(b.step + 1, live_tokens, live_scores, finished_tokens, finished_scores, state)

    final = jax.lax.while_loop(can_improve, step_once, start)
    best = jnp.argmax(final.finished_scores, axis=1)  # [B]
    tokens = jnp.take_along_axis(final.finished_tokens, best[:, None, None], axis=1)[:, 0]
    scores = jnp.take_along_axis(final.finished_scores, best[:, None], axis=1)[:, 0]
    return tokens, scores


def decode(model: Any, inputs: Array, *, beam_size: int, alpha: float, max_length_offset: int, length: int) -> Array:
    """The configured search: greedy for `beam_size == 1`, else beam search. Returns `[B, length]` ids."""
    max_lengths = source_lengths(inputs) + max_length_offset
    if beam_size == 1:
        return greedy_search(model, inputs, max_lengths, length)[0]
    return beam_search(model, inputs, max_lengths, length, beam_size=beam_size, alpha=alpha)[0]


class WithoutCache:
    """A model's decoding interface without its cache: every step reruns the teacher-forced
    decoder (`model.decode(targets, memory)`) over the whole prefix.

    A reference for cached decoding (same tokens and scores) and a baseline for what the cache saves.
    """

    FILLER = UNK_ID  # unknown future targets: any non-pad token (the causal mask hides them; pad would mask the row)

    def __init__(self, model: Any):
        self.model = model

    def encode(self, inputs: Array) -> Any:
        return self.model.encode(inputs)

    def init_decode_state(self, memory: Any, batch_size: int, max_len: int) -> tuple[Array, Array]:
        return jnp.full((batch_size, max_len), self.FILLER, jnp.int32), jnp.array(0)

    def decode_step(self, memory: Any, token: Array, state: tuple[Array, Array]) -> tuple[Array, tuple[Array, Array]]:
        targets, position = state
        targets = jnp.where(position > 0, targets.at[:, jnp.maximum(position - 1, 0)].set(token), targets)
        return self.model.decode(targets, memory)[:, position], (targets, position + 1)
