"""Whether this JAX keeps a bfloat16 matmul in bfloat16 on this CPU: the 2048^3 matmul rate in
float32 and in bfloat16, and the compiled HLO's dot (a bfloat16 `dot`, or float32 between converts).

    python benchmarks/bfloat16_matmul.py
    XLA_FLAGS=--xla_cpu_use_onednn=true python benchmarks/bfloat16_matmul.py

Run it in another environment (another jax/jaxlib) to compare releases; docs/performance.md,
"Against the strongest peers", has the rows measured.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from benchmarks.timing import matmul_peak_flops  # noqa: E402
from run_setup import command_line  # noqa: E402

FLAGS = flags.FlagValues()


def compiled_dot(dtype: str) -> str:
    """The dot line of the compiled HLO of `a @ a` in `dtype`, and whether converts surround it."""
    hlo = jax.jit(lambda a: a @ a).lower(jnp.zeros((64, 64), dtype)).compile().as_text()
    dot = next(line.split("=", 1)[1].split("{")[0].strip() for line in hlo.splitlines() if " dot(" in line)
    return f"{dot}{' between converts' if 'convert(' in hlo else ''}"


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| dtype | 2048^3 matmul GFLOP/s (median of 10) | compiled dot |")
    print("|---|---:|---|")
    for dtype in ("float32", "bfloat16"):
        print(f"| {dtype} | {matmul_peak_flops(dtype=dtype) / 1e9:.0f} | {compiled_dot(dtype)} |", flush=True)


if __name__ == "__main__":
    main()
