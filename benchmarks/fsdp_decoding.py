"""A search under `fsdp`: parameters gathered once per batch against at every step of its loop.

    python benchmarks/fsdp_decoding.py [--devices=8] [--repeats=5] [--config=configs/default.py]

Trains nothing: builds `--config`'s model under `--config.sharding=fsdp` on `--devices` forced
host devices, takes one dev batch, and compiles the evaluation's search twice: on the parameters
as they lie (`Run.model`: XLA gathers a weight's shards where the loop body uses it) and as runs
search (`Run.searching_model`: gathered whole along `data` before the loop). Prints the
collectives of each compiled program (inside the loop and in all), the median seconds of a
batch, and whether both decode the same tokens. The figures: docs/performance.md.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

from configs import base  # noqa: E402
from run_setup import command_line  # noqa: E402

# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_integer("devices", 8, "forced host devices", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "timed calls of each search (median)", flag_values=FLAGS)
flags.DEFINE_string("config", "configs/default.py", "FILE.py[:ARG]", flag_values=FLAGS)


COLLECTIVE = re.compile(r"\b(?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
CALLED = re.compile(
    r"(?:body|condition|calls|to_apply|branch_computations|true_computation|false_computation)"
    r"=\{?([^}\s]+(?:, ?%[^},\s]+)*)"
)


def collectives(hlo: str) -> tuple[int, int]:
    """`(inside while loops, in all)`: the collective instructions (all-gather, all-reduce,
    reduce-scatter, all-to-all, collective-permute) of a compiled program's text; inside a loop
    means in its body or in a computation the body calls, at any depth."""
    computations = dict(re.findall(r"^(?:ENTRY )?%?(\S+) \([^\n]*\{\n(.*?)\n\}$", hlo, re.MULTILINE | re.DOTALL))
    called = lambda text: {name.strip().lstrip("%") for group in CALLED.findall(text) for name in group.split(",")}  # noqa: E731
    inside, frontier = set(), set(re.findall(r"body=%?([\w.\-]+)", hlo))
    while frontier:
        name = frontier.pop()
        if name not in inside:
            inside.add(name)
            frontier |= called(computations.get(name, ""))
    return sum(len(COLLECTIVE.findall(computations.get(name, ""))) for name in inside), len(COLLECTIVE.findall(hlo))


def main(argv: list[str] | None = None) -> None:
    command_line.parse(FLAGS, argv or sys.argv, __doc__)
    args = FLAGS
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}".strip()
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np

    from benchmarks.timing import median_seconds
    from engine.evaluation import Evaluator
    from run_setup.run import prepare_run
    from run_setup.settings import parse
    from scoring import decoding

    settings = parse(base.load(args.config, ["--config.sharding=fsdp"]))
    with tempfile.TemporaryDirectory(prefix="fsdp_decoding_") as workdir:
        run = prepare_run(settings, workdir, training=False)
        evaluator = Evaluator(run)
        batch, _, _ = next(evaluator.batches("dev"))
        options, key = settings.decode.search_options(), jax.random.key(0)
        print(
            f"{args.config} under fsdp on {args.devices} devices: a dev batch of {batch['inputs'].shape[0]} rows, "
            f"{settings.decode.method} (beam {settings.decode.beam_size}), output length {evaluator.output_length}\n"
        )
        print("| parameters in the search | collectives in the loop | collectives in all | s per batch | same tokens |")
        print("|---|---:|---:|---:|---|")
        reference = None
        for name, model_of in (
            ("as they lie (run.model)", run.model),
            ("gathered once (run.searching_model)", run.searching_model),
        ):
            search = jax.jit(
                lambda params, inputs, key, model_of=model_of: decoding.decode(
                    model_of(params), inputs, length=evaluator.output_length, key=key, **options
                ),
                in_shardings=(run.param_shardings, run.batch_sharding, None),
            )
            inside, total = collectives(search.lower(run.params, batch["inputs"], key).compile().as_text())
            seconds = median_seconds(search, (run.params, batch["inputs"], key), args.repeats)
            tokens = np.asarray(search(run.params, batch["inputs"], key)[0])
            same = "" if reference is None else str(bool(np.array_equal(tokens, reference)))
            reference = tokens if reference is None else reference
            print(f"| {name} | {inside} | {total} | {seconds:.3f} | {same} |")


if __name__ == "__main__":
    main()
