"""Time and peak memory of each attention score function, at q = k in {128, 512, 2048}.

    python benchmarks/attention_score_speed.py [--lengths 128,512,2048] [--batch 2] [--heads 4] [--head_dim 64]

Peak memory is XLA's own figure for the compiled function: the temporary
buffers its buffer assignment needs at once (`memory_analysis().temp_size_in_bytes`),
for the forward pass and for forward + backward (gradient of the sum of the
output with respect to every input). Times are medians of repeated runs of the
compiled forward pass. The naive additive score (one chunk holding every query)
is compiled but, above 512, not run: it is there to show the memory chunking saves.

The chunk budget of the chunked additive score is the size of one chunk's tanh
tensor `[B, chunk, S, N, A]` plus twice the `[B, N, T, S]` scores (the mapped
output and its reshuffle); the last column checks the measured peak against it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from benchmarks.timing import median_seconds  # noqa: E402
from models import attention  # noqa: E402
from run_setup import command_line  # noqa: E402

MIB = 2**20


def score_functions(chunk: int, heads: int, head_dim: int):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(heads, head_dim, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(heads, head_dim)), jnp.float32)
    return {
        "scaled_dot (explicit, +softmax+values)": lambda q, k, val: attention.scaled_dot_product_attention(q, k, val)[
            0
        ],
        "scaled_dot (library jax.nn)": attention.library_scaled_dot_product_attention,
        "dot scores": lambda q, k, val: attention.dot_scores(q, k),
        "general scores": lambda q, k, val: attention.general_scores(q, k, w),
        f"additive scores (chunk {chunk})": lambda q, k, val: attention.additive_scores(
            q, k, v, query_chunk_size=chunk
        ),
        "additive scores (naive, one chunk)": lambda q, k, val: attention.additive_scores(
            q, k, v, query_chunk_size=q.shape[1]
        ),
    }


def compiled_peak(fn, args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("lengths", "128,512,2048", "", flag_values=FLAGS)
flags.DEFINE_integer("batch", 2, "", flag_values=FLAGS)
flags.DEFINE_integer("heads", 4, "", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 64, "also the additive dim A", flag_values=FLAGS)
flags.DEFINE_integer("chunk", 64, "query chunk of the additive score", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "", flag_values=FLAGS)


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    args = FLAGS

    b, n, h = args.batch, args.heads, args.head_dim
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, B={b} N={n} H=A={h}, float32")
    print("| length | function | forward ms (median) | forward peak MiB | fwd+bwd peak MiB | within chunk budget |")
    print("|---:|---|---:|---:|---:|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        rng = np.random.default_rng(length)
        q, k, val = (jnp.asarray(rng.normal(size=(b, length, n, h)), jnp.float32) for _ in range(3))
        for name, fn in score_functions(args.chunk, n, h).items():
            forward_peak = compiled_peak(fn, (q, k, val))
            grad = jax.grad(lambda q, k, val: jnp.sum(fn(q, k, val)), argnums=(0, 1, 2))
            backward_peak = compiled_peak(grad, (q, k, val))
            naive_too_big = "naive" in name and length > 512
            ms = "not run" if naive_too_big else f"{1e3 * median_seconds(jax.jit(fn), (q, k, val), args.repeats):.2f}"
            budget = ""
            if name.startswith("additive scores (chunk"):
                chunk_bytes = 4 * b * min(args.chunk, length) * length * n * h
                scores_bytes = 4 * b * n * length * length
                limit = chunk_bytes + 2 * scores_bytes
                ok = max(forward_peak, backward_peak) <= limit
                budget = f"{'yes' if ok else 'NO'} (budget {limit / MIB:.0f} MiB)"
            print(
                f"| {length} | {name} | {ms} | {forward_peak / MIB:.1f} | {backward_peak / MIB:.1f} | {budget} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
