"""Show, Attend and Tell on `digit_strips`: soft against hard attention, each with and without the
doubly stochastic penalty, under one step budget.

    python benchmarks/captioning_comparison.py --workdir=runs/captioning [--steps=3000] [--doubly_stochastic=1.0]

Each variant is `train.py` on `configs/captioner_digit_strips.py` (soft) or
`configs/captioner_hard_digit_strips.py` (hard) with `model.doubly_stochastic` 0 or the given
lambda, run one after the other in its own process; the table reports the test split's BLEU-4,
exact caption match and localisation accuracy (test strips are made of digit scans never seen in
training) from `eval/step_<steps>.json`, and each command's wall time on this machine. A variant
whose folder already holds the final evaluation is not trained again. The figures measured with
it: docs/performance.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
from absl import flags  # noqa: E402

from run_setup import command_line  # noqa: E402

CONFIGS = {"soft": "configs/captioner_digit_strips.py", "hard": "configs/captioner_hard_digit_strips.py"}


def run_variant(attention: str, penalty: float, steps: int, workdir: Path) -> tuple[dict, float | None]:
    """`(test results, wall seconds or None when reused)` of one variant."""
    final = workdir / "eval" / f"step_{steps}.json"
    if final.exists():
        return json.loads(final.read_text())["test"], None
    command = [
        sys.executable,
        str(PROJECT_ROOT / "train.py"),
        f"--config={PROJECT_ROOT / CONFIGS[attention]}",
        f"--workdir={workdir}",
        f"--config.num_train_steps={steps}",
        f"--config.model.doubly_stochastic={penalty}",
        f"--config.eval_every_steps={steps}",
        f"--config.checkpoint_every_steps={steps}",
    ]
    start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    # the run's own log.txt starts after set-up
    with open(workdir.parent / f"{workdir.name}.log", "w") as log:
        subprocess.run(command, cwd=PROJECT_ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(final.read_text())["test"], time.perf_counter() - start


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", "runs/captioning", "", flag_values=FLAGS)
flags.DEFINE_integer("steps", 3000, "", flag_values=FLAGS)
flags.DEFINE_float("doubly_stochastic", 1.0, "lambda of the variants with the penalty", flag_values=FLAGS)


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    args = FLAGS
    rows = []
    for attention in ("soft", "hard"):
        for penalty in (0.0, args.doubly_stochastic):
            name = f"{attention}_ds{penalty:g}"
            results, seconds = run_variant(attention, penalty, args.steps, Path(args.workdir) / name)
            rows.append((attention, penalty, results, seconds))
            print(f"{name}: done", file=sys.stderr, flush=True)
    print(f"digit_strips test split (unseen scans), {args.steps} steps of 64 strips each")
    print("| attention | doubly stochastic lambda | BLEU-4 | exact caption match | localisation accuracy | wall time |")
    print("|---|---:|---:|---:|---:|---:|")
    for attention, penalty, results, seconds in rows:
        wall = "reused" if seconds is None else f"{seconds / 60:.1f} min"
        print(
            f"| {attention} | {penalty:g} | {results['bleu']:.1f} | {results['exact_match']:.3f} | "
            f"{results['localization_accuracy']:.3f} | {wall} |"
        )


if __name__ == "__main__":
    main()
