"""The layout choices of the models on CPU, each forward + backward against its alternative.

    python benchmarks/layouts.py [--repeats 10]

At the kjv_web_transformer shape (64 rows x 128 tokens, d_model 256, 4 heads, d_ff 1024):

- feed-forward block: `nnx.Linear` on `[B, T, D]` against `models.layers.Linear`
  (the rows flattened to `[B*T, D]`, same parameters);
- self-attention core (projections included): einsums over `[B, T, N, H]`
  against the heads-major ones of `models.attention` (`heads_major`);
- the same through `jax.nn.dot_product_attention` (the library path, which
  `fused_scaled_dot_product_attention` takes off CPU).

Times are medians of compiled runs (benchmarks/timing.py). The figures measured with it:
docs/performance.md ("What each choice is worth").
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from benchmarks.timing import median_seconds  # noqa: E402
from models import attention  # noqa: E402
from models.layers import Linear  # noqa: E402
from run_setup import command_line  # noqa: E402

B, T, D, N, F = 64, 128, 256, 4, 1024


def feed_forward_seconds(linear: type, x: jax.Array, repeats: int) -> float:
    inner, outer = linear(D, F, rngs=nnx.Rngs(0)), linear(F, D, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split((inner, outer))

    @jax.jit
    def step(params, x):
        def loss(params, x):
            inner, outer = nnx.merge(graphdef, params)
            return jnp.sum(outer(jax.nn.relu(inner(x))) ** 2)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    return median_seconds(step, (params, x), repeats)


def attention_seconds(attend, x: jax.Array, repeats: int) -> float:
    weights = [jax.random.normal(jax.random.key(i), (D, D)) * D**-0.5 for i in range(4)]
    mask = attention.causal_mask(T)

    @jax.jit
    def step(weights, x):
        def loss(weights, x):
            rows = x.reshape(-1, D)
            q, k, v = ((rows @ w).reshape(B, T, N, D // N) for w in weights[:3])
            return jnp.sum((attend(q, k, v, mask).reshape(-1, D) @ weights[3]) ** 2)

        return jax.grad(loss, argnums=(0, 1))(weights, x)

    return median_seconds(step, (weights, x), repeats)


def token_major(q, k, v, mask):
    """The explicit path with its einsums over `[B, T, N, H]`: the alternative to `heads_major`'s layout."""
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / (q.shape[-1] ** 0.5)
    weights = attention.masked_softmax(scores, mask)
    return jnp.einsum("BNTS,BSNH->BTNH", weights, v)


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_integer("repeats", 10, "", flag_values=FLAGS)


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    args = FLAGS
    x = jax.random.normal(jax.random.key(9), (B, T, D))
    rows = [
        (
            "feed-forward block",
            "nnx.Linear on [B, T, D]",
            feed_forward_seconds(nnx.Linear, x, args.repeats),
            "models.layers.Linear (rows flattened)",
            feed_forward_seconds(Linear, x, args.repeats),
        ),
        (
            "self-attention",
            "einsums over [B, T, N, H]",
            attention_seconds(token_major, x, args.repeats),
            "heads-major einsums (explicit path)",
            attention_seconds(lambda *a: attention.scaled_dot_product_attention(*a)[0], x, args.repeats),
        ),
        (
            "self-attention",
            "jax.nn.dot_product_attention",
            attention_seconds(attention.library_scaled_dot_product_attention, x, args.repeats),
            "heads-major einsums (explicit path)",
            attention_seconds(lambda *a: attention.scaled_dot_product_attention(*a)[0], x, args.repeats),
        ),
    ]
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {B} x {T} tokens, d_model {D}, {N} heads, d_ff {F}; "
        "forward + backward, median ms"
    )
    print("| block | alternative | ms | attend's | ms |")
    print("|---|---|---:|---|---:|")
    for block, other, other_s, ours, ours_s in rows:
        print(f"| {block} | {other} | {other_s * 1e3:.1f} | {ours} | {ours_s * 1e3:.1f} |")


if __name__ == "__main__":
    main()
