"""Whether this JAX keeps a bfloat16 matmul in bfloat16 on this CPU: the 2048^3 matmul rate in
float32 and in bfloat16, and the compiled HLO's dot (a bfloat16 `dot`, or float32 between converts).

    python benchmarks/bfloat16_matmul.py
    XLA_FLAGS=--xla_cpu_use_onednn=true python benchmarks/bfloat16_matmul.py
    python benchmarks/bfloat16_matmul.py --cblas=MKL/lib/libmkl_rt.so.3

Run it in another environment (another jax/jaxlib) to compare releases. `--cblas` also times a
CBLAS library's float32 product and its bfloat16 one where it has one (MKL's
`cblas_gemm_bf16bf16f32`, OpenBLAS's `cblas_sbgemm`), called through ctypes: what a custom call
from XLA to that library would run at. The first line names the CPU's bfloat16 and AMX flags
(/proc/cpuinfo). docs/performance.md, "Against the strongest peers", has the rows measured.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from benchmarks.timing import matmul_peak_flops, median_seconds  # noqa: E402
from run_setup import command_line  # noqa: E402

FLAGS = flags.FlagValues()
flags.DEFINE_string("cblas", "", "also time this CBLAS library's float32 and bfloat16 products", flag_values=FLAGS)

# the bfloat16 x bfloat16 -> float32 products of the CBLAS libraries that have one
BFLOAT16_GEMMS = ("cblas_gemm_bf16bf16f32", "cblas_sbgemm")
SIZE = 2048


def matrix_flags() -> str:
    """The CPU's AMX, AVX-512-BF16 and AVX-512-FP16 flags as /proc/cpuinfo lists them."""
    try:
        listed = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown (no /proc/cpuinfo)"
    found = [flag for flag in listed.split() if flag.startswith("amx") or flag in ("avx512_bf16", "avx512_fp16")]
    return " ".join(found) or "none of them"


def cblas_rates(path: str, repeats: int = 10) -> dict[str, float]:
    """`{function: FLOP/s}` of `path`'s `cblas_sgemm` and bfloat16 product on SIZE^3, median of
    `repeats` calls after one untimed (row-major, no transposes, the bfloat16 operand the float32
    one's upper 16 bits)."""
    library = ctypes.CDLL(path)
    operand = np.random.default_rng(0).standard_normal((SIZE, SIZE), dtype=np.float32)
    truncated = (operand.view(np.uint32) >> 16).astype(np.uint16)
    product = np.zeros((SIZE, SIZE), np.float32)
    rates = {}
    functions = [("cblas_sgemm", operand)] + [(name, truncated) for name in BFLOAT16_GEMMS if hasattr(library, name)]
    for name, matrix in functions:
        pointer = ctypes.c_void_p(matrix.ctypes.data)
        # CblasRowMajor, CblasNoTrans twice, M N K, alpha, A lda, B ldb, beta, C ldc
        arguments = (101, 111, 111, SIZE, SIZE, SIZE, ctypes.c_float(1.0), pointer, SIZE, pointer, SIZE)
        arguments += (ctypes.c_float(0.0), ctypes.c_void_p(product.ctypes.data), SIZE)
        rates[name] = 2 * SIZE**3 / median_seconds(getattr(library, name), arguments, repeats)
    return rates


def compiled_dot(dtype: str) -> str:
    """The dot line of the compiled HLO of `a @ a` in `dtype`, and whether converts surround it."""
    hlo = jax.jit(lambda a: a @ a).lower(jnp.zeros((64, 64), dtype)).compile().as_text()
    dot = next(line.split("=", 1)[1].split("{")[0].strip() for line in hlo.splitlines() if " dot(" in line)
    return f"{dot}{' between converts' if 'convert(' in hlo else ''}"


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"the CPU's matrix flags: {matrix_flags()}")
    print(f"| dtype | {SIZE}^3 matmul GFLOP/s (median of 10) | compiled dot |")
    print("|---|---:|---|")
    for dtype in ("float32", "bfloat16"):
        print(f"| {dtype} | {matmul_peak_flops(dtype=dtype) / 1e9:.0f} | {compiled_dot(dtype)} |", flush=True)
    if FLAGS.cblas:
        rates = cblas_rates(FLAGS.cblas)
        print(f"\n{FLAGS.cblas}:\n\n| function | {SIZE}^3 GFLOP/s (median of 10) |\n|---|---:|")
        for name, rate in rates.items():
            print(f"| {name} | {rate / 1e9:.0f} |")
        if len(rates) == 1:
            print(f"(no bfloat16 product: none of {', '.join(BFLOAT16_GEMMS)})")


if __name__ == "__main__":
    main()
