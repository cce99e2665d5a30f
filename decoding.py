"""Search over the common decoding interface (`encode`, `init_decode_state`, `decode_step`).

Compiled with `lax.while_loop`: the loop stops as soon as every row has
produced eos, or at `max_length` tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tokenizers import BOS_ID, EOS_ID, PAD_ID

Array = jax.Array


def greedy_search(model: Any, inputs: Array, max_length: int) -> Array:
    """Most likely next token at each step.

    Args:
      model: any model with the common decoding interface.
      inputs: `[B, S]` source ids (0 = padding).
      max_length: output tokens at most (eos included).
    Returns:
      `[B, max_length]` ids: each row ends with eos, then padding.
    """
    batch = inputs.shape[0]
    memory = model.encode(inputs)
    state = model.init_decode_state(memory, batch, max_length)
    tokens = jnp.zeros((batch, max_length), jnp.int32)
    done = jnp.zeros((batch,), bool)
    previous = jnp.full((batch,), BOS_ID, jnp.int32)

    def not_finished(carry) -> Array:
        step, _, _, _, done = carry
        return (step < max_length) & ~jnp.all(done)

    def step_once(carry):
        step, previous, state, tokens, done = carry
        logits, state = model.decode_step(memory, previous, state)  # [B, V]
        logits = logits.at[:, [PAD_ID, BOS_ID]].set(-jnp.inf)  # never emitted
        chosen = jnp.where(done, PAD_ID, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        tokens = tokens.at[:, step].set(chosen)
        return step + 1, chosen, state, tokens, done | (chosen == EOS_ID)

    _, _, _, tokens, _ = jax.lax.while_loop(not_finished, step_once, (0, previous, state, tokens, done))
    return tokens
