"""Timing for the benchmarks: medians of repeated runs of compiled functions, the matmul peak."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_seconds(fn: Callable, args: tuple, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn(*args)` after `warmup` untimed calls (the first compiles it)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_flops(size: int = 2048, repeats: int = 10, dtype: str = "float32") -> float:
    """Median FLOP/s of a jitted square matmul in `dtype`."""
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def train_step_of(model, vocab_size: int, rows: int, length: int, seed: int = 0):
    """A jitted train step (forward, backward on the NLL, Adam) of an nnx `model` on random token
    batches of `rows` x `length` source and target ids: `(step, args)`, call `step(*args)`."""
    import optax
    from flax import nnx

    from scoring import metrics

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(1e-3)
    tokens = jax.random.randint(jax.random.key(seed), (2, rows, length), 3, vocab_size)
    batch = {"inputs": tokens[0], "targets": tokens[1]}

    @jax.jit
    def step(params, opt_state, batch):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(batch)
            return metrics.token_sums(logits, batch["targets"])["nll_sum"]

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params), batch)
