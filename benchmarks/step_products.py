"""The kjv_web_transformer step's matrix products, one at a time: XLA's rate against PyTorch's.

    python benchmarks/step_products.py [--torch_python=PEERS/torch/bin/python] [--repeats 50]
    XLA_FLAGS="..." python benchmarks/step_products.py       # an XLA:CPU back end's products

Each product of a microbatch (`--batch` rows x 128 tokens, d_model 256, 4 heads of 64, d_ff 1024,
8000 pieces) as the step runs it, jitted alone, median of `--repeats`: attention's batched products
(the scores, the weighted values and the gradient into the keys, which contracts the query
positions) and a `Linear`'s three (forward, into its input, into its weight) at each width. The
two products that contract the rows (a weight's gradient `x^T dy`, the keys' `dS^T Q`) come
twice: as autodiff writes them, and with their operands swapped (`dy^T x`, `Q^T dS`: the same
numbers, transposed), because XLA:CPU's Eigen path packs the operands of such a product at
different costs by their order (docs/performance.md, "Against the strongest peers"). Each
call writes a new output (the logits' page faults slow both libraries' `256->8000` forward
here, which the train step's kept memory does not see: utils/allocator.py). With
`--torch_python`, the same products in PyTorch (oneDNN/MKL, 2 threads) in that interpreter
(`TORCH_RATES`). Prints one table of GFLOP/s. The figures measured with it: docs/performance.md
("Against the strongest peers").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from benchmarks.peer_comparison import peer_python  # noqa: E402
from benchmarks.timing import median_seconds  # noqa: E402
from run_setup import command_line  # noqa: E402

# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("torch_python", os.environ.get("ATTEND_TORCH_PYTHON", ""), "PyTorch's python", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 50, "timed calls of each product", flag_values=FLAGS)
flags.DEFINE_integer(
    "batch", 8, "rows of a microbatch (configs/kjv_web_transformer.py: 64 in 8 microbatches)", flag_values=FLAGS
)

HEADS, LENGTH, HEAD_DIM = 4, 128, 64


def products(batch: int) -> list[tuple[str, str, tuple, tuple]]:
    """`(name, einsum, lhs shape, rhs shape)`: one microbatch's products as the step runs them,
    attention's in models/attention.py's heads-major layout, `[B, N, T, H]`."""
    rows = batch * LENGTH
    queries, weights = (batch, HEADS, LENGTH, HEAD_DIM), (batch, HEADS, LENGTH, LENGTH)
    found = [
        ("attention scores QK^T", "bnth,bnsh->bnts", queries, queries),
        ("attention weighted values PV", "bnts,bnsh->bnth", weights, queries),
        ("attention gradient into K or V, P^T dO", "bnts,bnth->bnsh", weights, queries),
        ("the same, operands swapped, (dO^T P)^T", "bnth,bnts->bnhs", queries, weights),
    ]
    for width_in, width_out in ((256, 256), (256, 1024), (1024, 256), (256, 8000)):
        found += [
            (f"Linear {width_in}->{width_out} forward", "mk,kn->mn", (rows, width_in), (width_in, width_out)),
            (f"Linear {width_in}->{width_out} into its input", "mn,kn->mk", (rows, width_out), (width_in, width_out)),
            (f"Linear {width_in}->{width_out} into its weight", "mk,mn->kn", (rows, width_in), (rows, width_out)),
            ("the same, operands swapped, (dy^T x)^T", "mn,mk->nk", (rows, width_out), (rows, width_in)),
        ]
    return found


def flop(equation: str, lhs: tuple, rhs: tuple) -> int:
    """2 x the product of every index's size (each index once)."""
    sizes = {}
    for letters, shape in zip(equation.split("->")[0].split(","), (lhs, rhs)):
        sizes.update(zip(letters, shape))
    return 2 * math.prod(sizes.values())


def xla_rates(found: list, repeats: int) -> list[float]:
    import jax
    import jax.numpy as jnp

    rates = []
    for _, equation, lhs, rhs in found:
        a, b = (jax.random.normal(jax.random.key(i), shape, jnp.float32) for i, shape in enumerate((lhs, rhs)))
        product = jax.jit(lambda a, b, equation=equation: jnp.einsum(equation, a, b))
        # three untimed calls: oneDNN's kernels (XLA_FLAGS=--xla_cpu_use_onednn...) are made on the first
        rates.append(flop(equation, lhs, rhs) / median_seconds(product, (a, b), repeats, warmup=3))
    return rates


# PyTorch's side, run in the peer's own interpreter (PyTorch is no dependency of this project):
# argv is the products as JSON `[[equation, lhs, rhs, flop], ...]` and the repeats; prints GFLOP/s.
TORCH_RATES = """
import json, statistics, sys, time, torch
torch.set_num_threads(2)
rates = []
for equation, lhs, rhs, flop in json.loads(sys.argv[1]):
    a, b = torch.randn(lhs), torch.randn(rhs)
    for _ in range(3):
        torch.einsum(equation, a, b)
    times = []
    for _ in range(int(sys.argv[2])):
        start = time.perf_counter()
        torch.einsum(equation, a, b)
        times.append(time.perf_counter() - start)
    rates.append(flop / statistics.median(times))
print(json.dumps(rates))
"""


def torch_rates(found: list, python: str, repeats: int) -> list[float]:
    shapes = json.dumps([[eq, lhs, rhs, flop(eq, lhs, rhs)] for _, eq, lhs, rhs in found])
    command = [python, "-c", TORCH_RATES, shapes, str(repeats)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    found = products(FLAGS.batch)
    xla = xla_rates(found, FLAGS.repeats)
    python = peer_python("torch", FLAGS.torch_python)
    torch = torch_rates(found, python, FLAGS.repeats) if python else None
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n")
    print("| product (one microbatch) | shapes | GFLOP | XLA GFLOP/s | PyTorch GFLOP/s |")
    print("|---|---|---:|---:|---:|")
    for i, (name, equation, lhs, rhs) in enumerate(found):
        theirs = f"{torch[i] / 1e9:.0f}" if torch else ""
        shapes = f"{equation}: {list(lhs)} x {list(rhs)}"
        print(f"| {name} | {shapes} | {flop(equation, lhs, rhs) / 1e9:.2f} | {xla[i] / 1e9:.0f} | {theirs} |")


if __name__ == "__main__":
    main()
