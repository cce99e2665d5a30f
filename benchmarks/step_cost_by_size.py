"""Train-step time and peak memory against sequence length and against model size.

    python benchmarks/step_cost_by_size.py [--lengths 64,128,256,512,1024,2048] [--tokens 4096]
                                 [--sizes 128,256,512,1024] [--repeats 2]

A train step here is forward, backward (NLL) and Adam on random token batches,
compiled once per shape (benchmarks/timing.py `train_step_of`); its time is
the median of `--repeats` runs after the compiling one. Peak memory is what
the compiled step holds at once by XLA's buffer assignment: its temporary
buffers plus its arguments (parameters, Adam's moments, the batch) and outputs
(`memory_analysis()`), in MiB.

- Against length: the kjv_web Transformer's shape (3+3 layers, d_model 256,
  4 heads, d_ff 1024, 8000-token vocabulary) with scaled dot-product scores and
  with additive scores (Bahdanau's `v^T tanh(q + k)` per head, the chunked
  score of models/attention.py), on batches of `--tokens` source and target
  tokens each (rows = tokens / length). The last column is what the `[B, T, S, N, A]`
  tanh tensors of an unchunked additive score take, one per attention layer (9
  here; the backward pass keeps more than that): it grows with the length at a
  fixed token count, where the chunked score's (models/attention.py `additive_scores`) does
  not; up to one chunk (64 queries) the score is not chunked and keeps its tensors.
- Against size: the Transformer with d_model in `--sizes` (d_model / 64 heads,
  d_ff 4 d_model, 3+3 layers) at length 128, with its parameters and FLOP rate.

The figures measured with it: docs/performance.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from benchmarks.timing import median_seconds, train_step_of  # noqa: E402
from run_setup import command_line  # noqa: E402

MIB = 2**20
VOCAB = 8000


def measure(rows: int, length: int, repeats: int, **fields) -> dict:
    """Seconds, peak MiB, FLOP and parameters of a Transformer train step on `rows` x `length` tokens."""
    from flax import nnx

    import models

    model = models.create_model("transformer", rngs=nnx.Rngs(0), vocab_size=VOCAB, dropout_rate=0.0, **fields)
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    step, args = train_step_of(model, VOCAB, rows, length)
    compiled = step.lower(*args).compile()
    memory = compiled.memory_analysis()
    peak = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    return {
        "seconds": median_seconds(step, args, repeats),
        "peak_mib": peak / MIB,
        "flop": compiled.cost_analysis()["flops"],
        "parameters": parameters,
    }


def length_table(lengths: list[int], tokens: int, repeats: int) -> None:
    shape = dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3)
    print(f"Transformer 3+3 layers, d_model 256, 4 heads, d_ff 1024; {tokens} source and {tokens} target tokens a step")
    print(
        "| length | rows | dot s/step | dot peak MiB | additive s/step | additive peak MiB "
        "| one unchunked tanh tensor per layer, MiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length in lengths:
        rows = max(tokens // length, 1)
        dot = measure(rows, length, repeats, **shape)
        additive = measure(rows, length, repeats, score="additive", **shape)
        # self (and cross) attention layers
        layers = shape["num_encoder_layers"] + 2 * shape["num_decoder_layers"]
        # [B, T, S, N, A] float32, N x A = d_model
        unchunked = layers * rows * length * length * shape["d_model"] * 4 / MIB
        print(
            f"| {length} | {rows} | {dot['seconds']:.3f} | {dot['peak_mib']:,.0f} | {additive['seconds']:.3f} | "
            f"{additive['peak_mib']:,.0f} | {unchunked:,.0f} |",
            flush=True,
        )


def size_table(sizes: list[int], tokens: int, repeats: int) -> None:
    length = 128
    rows = max(tokens // length, 1)
    print(f"\nTransformer 3+3 layers, d_model / 64 heads, d_ff 4 d_model; {rows} rows x {length} tokens a step")
    print("| d_model | parameters | s/step | peak MiB | GFLOP/step | achieved GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        shape = dict(
            d_model=size, num_heads=max(size // 64, 1), d_ff=4 * size, num_encoder_layers=3, num_decoder_layers=3
        )
        r = measure(rows, length, repeats, **shape)
        print(
            f"| {size} | {r['parameters'] / 1e6:.1f}M | {r['seconds']:.3f} | {r['peak_mib']:,.0f} | "
            f"{r['flop'] / 1e9:.1f} | {r['flop'] / r['seconds'] / 1e9:.0f} |",
            flush=True,
        )


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("lengths", "64,128,256,512,1024,2048", "", flag_values=FLAGS)
flags.DEFINE_string("sizes", "128,256,512,1024", "", flag_values=FLAGS)
flags.DEFINE_integer("tokens", 4096, "", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 2, "", flag_values=FLAGS)


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    args = FLAGS
    import train

    # as a training process: the allocator and the compilation cache
    train.set_up_process()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    length_table([int(n) for n in args.lengths.split(",")], args.tokens, args.repeats)
    size_table([int(n) for n in args.sizes.split(",")], args.tokens, args.repeats)


if __name__ == "__main__":
    from utils import allocator

    # as train.py runs (the imports above are paid twice)
    allocator.restart_with_huge_pages(__file__)
    main()
