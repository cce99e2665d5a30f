"""Throughput of the input pipeline alone, against what training consumes.

    python benchmarks/pipeline_throughput.py [--configs default,kjv_web_transformer] [--batches 300]

For each config: examples/s, target tokens/s and all tokens/s (non-padding,
source + target) of the training batches the pipeline delivers with the
config's settings (tokenize, select, shuffle, pack or bucket, batch, prefetch),
median over windows after a warm-up. Then, in the same run, training's own
consumption (non-padding target tokens/s of the real train loop, measured by
benchmarks/train_throughput.py in a fresh process), and the ratio. The
pipeline should deliver at least 10 times what training consumes.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
from absl import flags  # noqa: E402

import input_pipeline  # noqa: E402
from run_setup import command_line  # noqa: E402
from run_setup.run import load_task_and_tokenizers  # noqa: E402
from run_setup.settings import parse  # noqa: E402


def examples_in(batch: dict) -> int:
    """Packed rows count their segments; padded rows count when non-empty."""
    if "targets_segment_ids" in batch:
        return int(sum(len(np.unique(row[row > 0])) for row in batch["targets_segment_ids"]))
    return int((batch["targets"] > 0).any(axis=1).sum())


def pipeline_rates(config: str | Path, overrides: list[str], batches: int, window: int) -> dict:
    """Rates of the training batches of config file `config` with `--config.a.b=v` `overrides`."""
    from configs import base

    settings = parse(base.load(config, overrides))
    with tempfile.TemporaryDirectory() as workdir:
        task, tokens = load_task_and_tokenizers(settings, Path(workdir))
        data, _ = input_pipeline.train_dataset(task, tokens, settings.data, settings.source)
        iterator = iter(data)
        # warm-up: threads started, buffers filled
        for _ in range(window):
            next(iterator)
        example_rates, target_rates, all_rates = [], [], []
        for _ in range(batches // window):
            start = time.perf_counter()
            counts = np.zeros(3)
            for _ in range(window):
                batch = next(iterator)
                counts += (
                    examples_in(batch),
                    (batch["targets"] > 0).sum(),
                    (batch["inputs"] > 0).sum() + (batch["targets"] > 0).sum(),
                )
            elapsed = time.perf_counter() - start
            example_rates.append(counts[0] / elapsed)
            target_rates.append(counts[1] / elapsed)
            all_rates.append(counts[2] / elapsed)
    return {
        "examples_per_s": statistics.median(example_rates),
        "target_tokens_per_s": statistics.median(target_rates),
        "all_tokens_per_s": statistics.median(all_rates),
        "batching": settings.data.batching,
    }


def training_tokens_per_second(config_name: str, steps: int) -> float:
    script = PROJECT_ROOT / "benchmarks" / "train_throughput.py"
    command = [sys.executable, str(script), "--one", config_name, "--steps", str(steps), "--window", "10"]
    output = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])["tokens_per_s"]


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("configs", "default,kjv_web_transformer", "", flag_values=FLAGS)
flags.DEFINE_integer("batches", 300, "", flag_values=FLAGS)
flags.DEFINE_integer("window", 20, "", flag_values=FLAGS)
flags.DEFINE_integer("train_steps", 30, "steps of the training measurement", flag_values=FLAGS)


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    args = FLAGS
    print(
        "| config | batching | examples/s | target tokens/s | all tokens/s | training consumes target tokens/s "
        "| pipeline / training |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.configs.split(","):
        rates = pipeline_rates(PROJECT_ROOT / "configs" / f"{name}.py", [], args.batches, args.window)
        consumed = training_tokens_per_second(name, args.train_steps)
        print(
            f"| {name} | {rates['batching']} | {rates['examples_per_s']:,.0f} | {rates['target_tokens_per_s']:,.0f} | "
            f"{rates['all_tokens_per_s']:,.0f} | {consumed:,.0f} | {rates['target_tokens_per_s'] / consumed:.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
