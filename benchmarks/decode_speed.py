"""Decoding speed: greedy and beam 4, with and without the key/value cache, at source lengths 16, 64, 256.

    python benchmarks/decode_speed.py [--lengths 16,64,256] [--batch 8] [--repeats 3] [--cache=yes|no|both]
    python benchmarks/decode_speed.py --cache=yes --profile 12   # where a decoding step's time goes
    python benchmarks/decode_speed.py --workdir=RUN [--split data/kjv_web/test.tsv] [--beams 1,4]

With `--workdir`, a trained run's latest checkpoint decodes every source of a
split file (the first column of each line) through the Python inference API
(`inference.load(RUN).translate_ids`), once per beam size, in this process:
start-up (process start to the restored parameters) is reported apart from
decoding, which is timed from the first decode call to the last (compilations
included; the second column of the table says how many there were, and their
seconds), with
sentences/s and generated tokens/s (eos included, as one generated token).

The model is the kjv_web Transformer's size (3+3 layers, d_model 256, 4 heads,
d_ff 1024, 8000-token vocabulary), with random parameters and a fixed output
length equal to the source length (eos is never chosen, so every configuration
generates the same number of tokens). "Without the cache" reruns the
teacher-forced decoder over the whole prefix at every step, as a model without
incremental decoding must. Times are medians of repeated compiled runs. `--profile N` then
traces three more runs of each row (`jax.profiler`) and lists its N instructions of most time, in
microseconds a decoding step, as `benchmarks/step_profile.py` matches events to instructions.

The figures measured with `--workdir`, with the commands that train the runs: docs/performance.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
from absl import flags  # noqa: E402

import models  # noqa: E402
from benchmarks.timing import matmul_peak_flops, median_seconds  # noqa: E402
from run_setup import command_line  # noqa: E402
from scoring import decoding  # noqa: E402
from tasks.vocabularies import EOS_ID  # noqa: E402


class NoEos:
    """Wraps a model so that eos never wins until the length limit forces it."""

    def __init__(self, model):
        self.model = model
        self.memory_per_source = getattr(model, "memory_per_source", False)

    def encode(self, inputs):
        return self.model.encode(inputs)

    def init_decode_state(self, memory, batch_size, max_len):
        return self.model.init_decode_state(memory, batch_size, max_len)

    def decode_step(self, memory, token, state):
        logits, state = self.model.decode_step(memory, token, state)
        return logits.at[:, EOS_ID].set(-1e9), state


def decode_run(workdir: str, split: str, beams: list[int]) -> None:
    """The `--workdir` table: a trained run decoding a split file, timed as the module docstring says."""
    import psutil

    import train

    # as train.py: the allocator and the persistent compilation cache
    train.set_up_process()
    import inference

    translator = inference.load(workdir)
    startup = time.time() - psutil.Process().create_time()
    sources = [line.split("\t")[0] for line in Path(split).read_text(encoding="utf-8").splitlines() if line.strip()]
    print(
        f"{workdir} (step {translator.step}) on {jax.devices()[0].platform}: {len(sources)} sources of {split}; "
        f"start-up {startup:.1f} s"
    )
    print("| search | compilations (s) | decode s | sentences/s | generated tokens/s | generated tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    # seconds of each compilation (cache hits are not compilations)
    compilations = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: (
            compilations.append(seconds) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    for beam in beams:
        compilations.clear()
        start = time.perf_counter()
        outputs = translator.translate_ids(sources, beam_size=beam)
        seconds = time.perf_counter() - start
        generated = sum(len(hypotheses[0][0]) for hypotheses in outputs if hypotheses)
        name = "greedy" if beam == 1 else f"beam {beam}"
        print(
            f"| {name} | {len(compilations)} ({sum(compilations):.1f}) | {seconds:.1f} | "
            f"{len(sources) / seconds:,.1f} | {generated / seconds:,.0f} | {generated:,} |",
            flush=True,
        )


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("lengths", "16,64,256", "", flag_values=FLAGS)
flags.DEFINE_integer("batch", 8, "", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 3, "", flag_values=FLAGS)
flags.DEFINE_string("workdir", None, "a trained run: decode --split with its latest checkpoint", flag_values=FLAGS)
flags.DEFINE_string("split", str(PROJECT_ROOT / "data" / "kjv_web" / "test.tsv"), "", flag_values=FLAGS)
flags.DEFINE_string("beams", "1,4", "", flag_values=FLAGS)
flags.DEFINE_enum(
    "cache", "both", ["yes", "no", "both"], "the rows with the key/value cache, without it, or both", flag_values=FLAGS
)
flags.DEFINE_integer("profile", 0, "list each row's N instructions of most time (0: none)", flag_values=FLAGS)


def print_profile(search, args: tuple, steps: int, top: int) -> None:
    """The `top` instructions of a jitted `search` by traced time, in microseconds a decoding step
    (`steps` a call) over three calls."""
    from benchmarks.step_profile import parse_program, recorded_trace, traced_microseconds

    instructions = parse_program(search.lower(*args).compile().as_text())
    calls = 3
    trace = recorded_trace(lambda: [jax.block_until_ready(search(*args)) for _ in range(calls)])
    total, count = traced_microseconds(trace, instructions)
    per_step = calls * steps
    print(f"    traced {sum(total.values()) / per_step:,.0f} us a step; the instructions of most time:")
    for name, microseconds in total.most_common(top):
        instruction = instructions[name]
        print(
            f"    {microseconds / per_step:8.1f} us {count[name] / per_step:5.2f} a step  "
            f"{instruction.shape.split('{')[0]:24s} {instruction.op_name or instruction.opcode}"
        )


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    args = FLAGS
    if args.workdir:
        if args.profile:
            raise SystemExit("--profile lists the random-parameter rows' instructions; not with --workdir")
        return decode_run(args.workdir, args.split, [int(b) for b in args.beams.split(",")])
    model = models.create_model(
        "transformer",
        rngs=nnx.Rngs(0),
        vocab_size=8000,
        d_model=256,
        num_heads=4,
        d_ff=1024,
        num_encoder_layers=3,
        num_decoder_layers=3,
        dropout_rate=0.0,
    )
    graphdef, params = nnx.split(model)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; batch {args.batch}; output length = source length")
    print(f"float32 matmul peak (2048^3, median of 10): {matmul_peak_flops() / 1e9:.0f} GFLOP/s")
    print("| source length | search | cache | sentences/s | generated tokens/s |")
    print("|---:|---|---|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        inputs = jnp.asarray(np.random.default_rng(length).integers(4, 8000, (args.batch, length)), jnp.int32)
        limits = jnp.full((args.batch,), length)
        for search, beam in (("greedy", 1), ("beam 4", 4)):
            for cached in {"yes": (True,), "no": (False,), "both": (True, False)}[args.cache]:

                def run(params, inputs):
                    model = nnx.merge(graphdef, params)
                    m = NoEos(model if cached else decoding.WithoutCache(model))
                    if beam == 1:
                        return decoding.greedy_search(m, inputs, limits, length)[0]
                    return decoding.beam_search(m, inputs, limits, length, beam_size=beam, alpha=0.6)[0]

                jitted_search = jax.jit(run)
                seconds = median_seconds(jitted_search, (params, inputs), args.repeats)
                print(
                    f"| {length} | {search} | {'yes' if cached else 'no'} | {args.batch / seconds:,.2f} | "
                    f"{args.batch * length / seconds:,.0f} |",
                    flush=True,
                )
                if args.profile:
                    print_profile(jitted_search, (params, inputs), length, args.profile)


if __name__ == "__main__":
    from utils import allocator

    # as train.py runs (the imports above are paid twice)
    allocator.restart_with_huge_pages(__file__)
    main()
