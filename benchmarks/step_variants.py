"""Variants of a config's train step timed against each other in one process, their steps alternated.

    python benchmarks/step_variants.py [--config kjv_web_transformer] [--rounds 16] --variant=OVERRIDES ...
    python benchmarks/step_variants.py --variant="" --variant="--config.grad_accum_steps=4 --config.grad_accum_unroll=1"
    python benchmarks/step_variants.py --variant="" --variant="xla:xla_cpu_use_xnnpack=false"

Each `--variant` is a list of train.py overrides (empty: the config as it is) and of XLA options
written `xla:NAME=VALUE` (XLA_FLAGS' debug options, for this variant's compilation alone: XLA_FLAGS
hold for the whole process, which would leave flags to be compared one process at a time). Every variant's step
is built as train.py's loop builds it (`train_throughput.prepared_step`), compiled once and run twice;
then each round runs one step of every variant in turn. This machine's speed drifts by 10-15%
within minutes, more than the changes worth measuring, so the table gives each variant's median
step beside the median over rounds of its step divided by the first variant's in the same round,
and the XLA buffer of its compiled step (`memory_analysis`'s temporaries, GiB). On huge pages
train.py maps that buffer afresh at every step: a larger buffer costs more there than here.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
from absl import flags  # noqa: E402

from benchmarks.train_throughput import prepared_step  # noqa: E402
from run_setup import command_line  # noqa: E402

FLAGS = flags.FlagValues()
flags.DEFINE_string("config", "kjv_web_transformer", "configs/NAME.py", flag_values=FLAGS)
flags.DEFINE_multi_string(
    "variant",
    [],
    "train.py overrides and xla:NAME=VALUE compile options of one variant, space-separated ('' for none)",
    flag_values=FLAGS,
)
flags.DEFINE_integer("rounds", 16, "timed steps of each variant, alternated", flag_values=FLAGS)


def split_variant(variant: str) -> tuple[list[str], dict[str, bool | str]]:
    """`(train.py overrides, XLA compile options)` of a `--variant`: its `xla:NAME=VALUE` words are
    options, the other words overrides. `true`/`false` become booleans (XLA reads the string "false"
    as no boolean); any other value goes as written, which XLA parses by the option's type (`512`,
    `-1`, `1.5`, an enum's name)."""
    overrides, options = [], {}
    for word in variant.split():
        if not word.startswith("xla:"):
            overrides.append(word)
            continue
        name, equals, value = word.removeprefix("xla:").partition("=")
        if not (name and equals and value):
            raise ValueError(f"an XLA option is written xla:NAME=VALUE, got {word!r}")
        if name in options:
            raise ValueError(f"XLA option {name} given twice in one variant: {variant!r}")
        options[name] = {"true": True, "false": False}.get(value.lower(), value)
    return overrides, options


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    import jax

    import train
    from configs import base

    train.set_up_process()
    variants = FLAGS.variant or [""]
    with contextlib.ExitStack() as stack:
        # per variant: (run, compiled step, batches), its state, its XLA buffer (GiB)
        prepared, states, buffers = [], [], []
        for variant in variants:
            overrides, options = split_variant(variant)
            config = base.load(PROJECT_ROOT / "configs" / f"{FLAGS.config}.py", overrides)
            run, step, state, batches = stack.enter_context(prepared_step(config))
            batch = run.global_batch(next(batches))
            compiled = step.lower(state, batch).compile(compiler_options=options or None)
            buffers.append(compiled.memory_analysis().temp_size_in_bytes / 2**30)
            for _ in range(2):
                state, _ = compiled(state, batch)
            prepared.append((run, compiled, batches))
            states.append(jax.block_until_ready(state))
        seconds = [[] for _ in variants]
        for _ in range(FLAGS.rounds):
            for index, (run, compiled, batches) in enumerate(prepared):
                batch = run.global_batch(next(batches))
                start = time.perf_counter()
                states[index], _ = compiled(states[index], batch)
                jax.block_until_ready(states[index])
                seconds[index].append(time.perf_counter() - start)
    print(f"{FLAGS.config}: {FLAGS.rounds} rounds, one step of each variant a round\n")
    print("| variant | s/step (median) | / the first's, same round (median) | XLA buffer, GiB |")
    print("|---|---:|---:|---:|")
    for variant, times, buffer in zip(variants, seconds, buffers, strict=True):
        ratio = statistics.median(t / first for t, first in zip(times, seconds[0], strict=True))
        print(f"| {variant or '(as configured)'} | {statistics.median(times):.3f} | {ratio:.3f} | {buffer:.2f} |")


if __name__ == "__main__":
    # Not on huge pages (train.py's `allocator.restart_with_huge_pages`): there every step maps its
    # buffer afresh, and with buffers of several sizes alternating, the largest variant's steps were
    # charged 25-40% more (page faults, compaction) than the same program alone. On the heap that
    # `train.set_up_process` keeps (`allocator.keep_freed_memory`) every variant reuses its memory.
    main()
