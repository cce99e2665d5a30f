"""A search under `fsdp`: parameters gathered once per batch against at every step of its loop.

    python benchmarks/fsdp_decoding.py [--devices=8] [--repeats=5] [--config=configs/default.py]

Trains nothing: builds `--config`'s model under `--config.sharding=fsdp` on `--devices` forced
host devices, takes one dev batch, and compiles the evaluation's search twice: on the parameters
as they lie (`Run.model`: XLA gathers a weight's shards where the loop body uses it) and as runs
search (`Run.searching_model`: gathered whole along `data` before the loop). Prints the
all-gathers of each compiled program (inside the loop's body and in all), the median seconds of a
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

FLAGS = flags.FlagValues()  # this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
flags.DEFINE_integer("devices", 8, "forced host devices", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "timed calls of each search (median)", flag_values=FLAGS)
flags.DEFINE_string("config", "configs/default.py", "FILE.py[:ARG]", flag_values=FLAGS)


def all_gathers(hlo: str) -> tuple[int, int]:
    """`(inside while loops' bodies, in all)`: the all-gather instructions of a compiled program's text."""
    computations = dict(re.findall(r"^(?:ENTRY )?%?(\S+) \([^\n]*\{\n(.*?)\n\}$", hlo, re.MULTILINE | re.DOTALL))
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    gathers = lambda text: len(re.findall(r"\ball-gather(?:-start)?\(", text))  # noqa: E731
    return sum(gathers(computations.get(body, "")) for body in bodies), gathers(hlo)


def main(argv: list[str] | None = None) -> None:
    command_line.parse(FLAGS, argv or sys.argv, __doc__)
    args = FLAGS
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np

    import decoding
    from evaluation import Evaluator
    from run_setup.run import prepare_run
    from settings import parse
    from benchmarks.timing import median_seconds

    settings = parse(base.load(args.config, ["--config.sharding=fsdp"]))
    run = prepare_run(settings, tempfile.mkdtemp(prefix="fsdp_decoding_"), training=False)
    evaluator = Evaluator(run)
    batch, _, _ = next(evaluator.batches("dev"))
    options, key = settings.decode.search_options(), jax.random.key(0)
    print(f"{args.config} under fsdp on {args.devices} devices: a dev batch of {batch['inputs'].shape[0]} rows, "
          f"{settings.decode.method} (beam {settings.decode.beam_size}), output length {evaluator.output_length}\n")  # fmt: skip
    print("| parameters in the search | all-gathers in the loop | all-gathers in all | s per batch | same tokens |")
    print("|---|---:|---:|---:|---|")
    reference = None
    for name, model_of in (("as they lie (run.model)", run.model), ("gathered once (run.searching_model)", run.searching_model)):
        search = jax.jit(
            lambda params, inputs, key, model_of=model_of: decoding.decode(model_of(params), inputs, length=evaluator.output_length, key=key, **options),
            in_shardings=(run.param_shardings, run.batch_sharding, None),
        )  # fmt: skip
        inside, total = all_gathers(search.lower(run.params, batch["inputs"], key).compile().as_text())
        seconds = median_seconds(search, (run.params, batch["inputs"], key), args.repeats)
        tokens = np.asarray(search(run.params, batch["inputs"], key)[0])
        same = "" if reference is None else str(bool(np.array_equal(tokens, reference)))
        reference = tokens if reference is None else reference
        print(f"| {name} | {inside} | {total} | {seconds:.3f} | {same} |")


if __name__ == "__main__":
    main()
