"""attend against the strongest peers on this machine, back to back in one run, as ratios.

    python benchmarks/peer_comparison.py --torch_python=PEERS/torch/bin/python --ct2_python=PEERS/ct2/bin/python
    python benchmarks/peer_comparison.py --part=decode --lengths=16,64 ...

Training (`--part=train`): the kjv_web Transformer's step (64 rows of 128 + 128 tokens, 3+3 layers,
d_model 256), in this order: PyTorch eager float32, attend float32 (train.py's loop: the median of
its logged rows from step 20, each the mean of the 10 steps before it,
`benchmarks/train_throughput.py --train_py`), attend float32 with the peer's dropout, PyTorch
`torch.compile` float32, PyTorch eager bfloat16 autocast, attend `--config.model.dtype=bfloat16`,
PyTorch compiled bfloat16 (`../shared/peers/torch_transformer_cpu.py`). The peer's
`nn.Transformer(dropout=0.1)` also drops attention's weights and the feed-forward block's hidden
units, which the paper and attend's config do not; the row with the peer's dropout
(`--config.model.attention_dropout_rate=0.1 --config.model.relu_dropout_rate=0.1`) compares the same
work, beside the targets' rows. Each row prints its own matmul rate, measured
in the same process as its step, and the kernel's share: the system CPU seconds and minor page faults
of the row's whole process (its set-up and matmul test included) over the steps it ran. Eager
PyTorch's allocator hands its large tensors (the `[8192, 8000]` logits, 262 MB) back to the kernel
and faults them in again every step, so its step follows what a page fault costs on the host, which
varies on a virtual machine: on this one, from about 1 to 2.7 s of system time a step.

Decoding (`--part=decode`): `benchmarks/decode_speed.py --cache=yes` (random weights, batch 8,
output length = source length) against `../shared/peers/ct2_decode_cpu.py` (CTranslate2 float32) on
the same work, greedy and beam 4, generated tokens/s: `--rounds` rounds of the two, alternated,
each row the median of its rounds.

The peers run in environments of their own (`pip install torch numpy`, `pip install ctranslate2
numpy`; `../shared/peers/README.md`), named by `--torch_python` and `--ct2_python` or the
environment variables ATTEND_TORCH_PYTHON and ATTEND_CT2_PYTHON; a peer without one is skipped
with one line saying so.
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
from absl import flags  # noqa: E402

from run_setup import command_line  # noqa: E402

FLAGS = flags.FlagValues()
flags.DEFINE_string("torch_python", os.environ.get("ATTEND_TORCH_PYTHON", ""), "PyTorch's python", flag_values=FLAGS)
flags.DEFINE_string("ct2_python", os.environ.get("ATTEND_CT2_PYTHON", ""), "CTranslate2's python", flag_values=FLAGS)
flags.DEFINE_string("peers", str(PROJECT_ROOT.parent / "shared" / "peers"), "the peers' scripts", flag_values=FLAGS)
flags.DEFINE_enum("part", "both", ["train", "decode", "both"], "what to compare", flag_values=FLAGS)
flags.DEFINE_integer("train_steps", 40, "attend's train.py steps (rows from step 20 are timed)", flag_values=FLAGS)
flags.DEFINE_integer("torch_steps", 10, "PyTorch's timed steps (after 5 untimed)", flag_values=FLAGS)
flags.DEFINE_string("lengths", "16,64,256", "decoding: source lengths", flag_values=FLAGS)
flags.DEFINE_integer("batch", 8, "decoding: sentences per call", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 3, "decoding: timed calls per row", flag_values=FLAGS)
flags.DEFINE_integer("rounds", 3, "decoding: rounds of attend then CTranslate2 (medians)", flag_values=FLAGS)

# "| 16 | greedy | yes | 136.16 | 2,179 |": a decoding row of both scripts
DECODE_ROW = re.compile(r"^\| (\d+) \| (greedy|beam 4) \| yes \| [\d,.]+ \| ([\d,]+) \|$", re.M)


def run(command: list[str]) -> str:
    """`command`'s standard output; a failure ends the benchmark with the command's own output."""
    return run_with_kernel_time(command)[0]


def run_with_kernel_time(command: list[str]) -> tuple[str, float, int]:
    """`(standard output, system CPU seconds, minor page faults)` of `command` and the processes it
    waited for; a failure ends the benchmark with the command's own output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout, after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt


def peer_python(name: str, path: str) -> str | None:
    """The peer's interpreter, or None (said in one line) where none is named or it does not exist."""
    if path and Path(path).is_file():
        return path
    print(f"skipped: {name} (no interpreter: --{name}_python or ATTEND_{name.upper()}_PYTHON)", flush=True)
    return None


# The PyTorch peer's untimed steps before its timed ones (its --warmup default)
TORCH_WARMUP_STEPS = 5


@dataclasses.dataclass(frozen=True)
class StepRun:
    """A row: the median step, the matmul rate of its process, and that process's system CPU seconds
    and minor page faults over the steps it ran."""

    seconds: float
    matmul_gflops: float
    system_seconds_a_step: float
    faults_a_step: float


def torch_step(python: str, *options: str) -> StepRun:
    """The PyTorch peer's step with `options`."""
    script = str(Path(FLAGS.peers) / "torch_transformer_cpu.py")
    command = [python, script, "--threads", "2", "--steps", str(FLAGS.torch_steps), *options]
    output, system, faults = run_with_kernel_time(command)
    steps = TORCH_WARMUP_STEPS + FLAGS.torch_steps
    step = float(re.search(r"step ([\d.]+) s median", output).group(1))
    peak = float(re.search(r"matmul peak (\d+) GFLOP/s", output).group(1))
    return StepRun(step, peak, system / steps, faults / steps)


def attend_step(*overrides: str) -> StepRun:
    """train.py's step on kjv_web_transformer (the matmul rate of the step's dtype)."""
    command = [sys.executable, "benchmarks/train_throughput.py", "--train_py", "--steps", str(FLAGS.train_steps)]
    output, system, faults = run_with_kernel_time([*command, *overrides])
    row = next(line for line in output.splitlines() if line.startswith("| train.py"))
    peak = float(re.search(r"\): (\d+) GFLOP/s", output).group(1))
    # the steps/s column (three decimals) rather than the rounded s/step beside it
    seconds = 1 / float(row.split("|")[2])
    return StepRun(seconds, peak, system / FLAGS.train_steps, faults / FLAGS.train_steps)


# nn.Transformer(dropout=0.1), the peer's model, also drops attention's weights and the feed-forward
# block's hidden units, which the paper (section 5.4) and attend's config do not: this row does as
# the peer does, so that its ratio compares the same work
MATCHED_DROPOUT = "attend, float32, the peer's dropout (attention weights and feed-forward 0.1)"
PEER_DROPOUT = ("--config.model.attention_dropout_rate=0.1", "--config.model.relu_dropout_rate=0.1")


def compare_training() -> None:
    python = peer_python("torch", FLAGS.torch_python)
    rows = []
    plan = [
        ("PyTorch eager, float32", "torch", ()),
        ("attend, float32 (train.py)", "attend", ()),
        (MATCHED_DROPOUT, "attend", PEER_DROPOUT),
        ("PyTorch torch.compile, float32", "torch", ("--compile",)),
        ("PyTorch eager, bfloat16 autocast", "torch", ("--bf16",)),
        ("attend, --config.model.dtype=bfloat16", "attend", ("--config.model.dtype=bfloat16",)),
        ("PyTorch torch.compile, bfloat16", "torch", ("--compile", "--bf16")),
    ]
    for name, who, options in plan:
        if who == "torch" and python is None:
            continue
        measured = torch_step(python, *options) if who == "torch" else attend_step(*options)
        rows.append((name, measured))
        print(f"  {name}: {measured.seconds:.2f} s/step (matmul {measured.matmul_gflops:.0f} GFLOP/s)", flush=True)
    print(
        "\n| run, in the order run | s/step | its matmul GFLOP/s | this step / attend float32's "
        "| system CPU s a step | minor page faults a step |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    by_name = {name: measured.seconds for name, measured in rows}
    attend32 = by_name["attend, float32 (train.py)"]
    for name, measured in rows:
        print(
            f"| {name} | {measured.seconds:.2f} | {measured.matmul_gflops:.0f} | {measured.seconds / attend32:.2f} "
            f"| {measured.system_seconds_a_step:.2f} | {measured.faults_a_step:,.0f} |"
        )
    if python is not None:
        best_attend = min(seconds for name, seconds in by_name.items() if name.startswith("attend"))
        best_torch = min(seconds for name, seconds in by_name.items() if name.startswith("PyTorch"))
        eager = by_name["PyTorch eager, float32"]
        compiled = by_name["PyTorch torch.compile, float32"]
        print(f"\nattend float32 against PyTorch eager float32: {eager / attend32:.2f}x (target >= 2.0)")
        print(f"attend float32 against PyTorch compiled float32: {compiled / attend32:.2f}x (target >= 1.0)")
        print(
            f"attend float32 with the peer's dropout against PyTorch eager float32: "
            f"{eager / by_name[MATCHED_DROPOUT]:.2f}x (the same dropout work; no target)"
        )
        print(f"attend's best step against PyTorch's best step: {best_torch / best_attend:.2f}x (target >= 1.3)")


def decode_rows(output: str) -> dict[tuple[int, str], float]:
    return {(int(m[0]), m[1]): float(m[2].replace(",", "")) for m in DECODE_ROW.findall(output)}


def compare_decoding() -> None:
    """`--rounds` rounds of attend then CTranslate2, each a fresh process; the table holds each row's
    median over the rounds (this machine's speed drifts by 10% within minutes: alternating the two
    spreads a drift over both)."""
    common = ["--lengths", FLAGS.lengths, "--batch", str(FLAGS.batch), "--repeats", str(FLAGS.repeats)]
    python = peer_python("ct2", FLAGS.ct2_python)
    attend_rounds, ct2_rounds, peaks, ct2_peaks = [], [], [], []
    for number in range(FLAGS.rounds):
        ours = run([sys.executable, "benchmarks/decode_speed.py", "--cache=yes", *common])
        attend_rounds.append(decode_rows(ours))
        peaks.append(re.search(r"matmul peak .*?: (\d+) GFLOP/s", ours).group(1))
        if python:
            theirs = run([python, str(Path(FLAGS.peers) / "ct2_decode_cpu.py"), "--threads", "2", *common])
            ct2_rounds.append(decode_rows(theirs))
            ct2_peaks += [line for line in theirs.splitlines() if "matmul" in line]
        print(f"  round {number + 1} of {FLAGS.rounds} done", flush=True)
    attend, ct2 = median_rows(attend_rounds), median_rows(ct2_rounds)
    print(f"\nattend's float32 matmul rate in each round: {', '.join(peaks)} GFLOP/s")
    for line in ct2_peaks:
        print(line)
    print(f"\nMedians of {FLAGS.rounds} rounds (attend, then CTranslate2, in each):\n")
    print("| source length | search | attend tokens/s | CTranslate2 float32 tokens/s | attend / CTranslate2 |")
    print("|---:|---|---:|---:|---:|")
    for key, rate in attend.items():
        other = ct2.get(key)
        ratio = f"{rate / other:.2f}" if other else "-"
        print(f"| {key[0]} | {key[1]} | {rate:,.0f} | {f'{other:,.0f}' if other else '-'} | {ratio} |")
    beams = [rate / ct2[key] for key, rate in attend.items() if key[1] == "beam 4" and key in ct2]
    if beams:
        print(f"\nbeam 4: the slowest ratio {min(beams):.2f}, median {statistics.median(beams):.2f} (target >= 1.0)")
        per_round = [
            min(ours[key] / theirs[key] for key in ours if key[1] == "beam 4" and key in theirs)
            for ours, theirs in zip(attend_rounds, ct2_rounds)
        ]
        print(f"beam 4, the slowest ratio of each round: {', '.join(f'{r:.2f}' for r in per_round)}")


def median_rows(rounds: list[dict[tuple[int, str], float]]) -> dict[tuple[int, str], float]:
    """Each row's median over the rounds that have it."""
    keys = dict.fromkeys(key for rows in rounds for key in rows)
    return {key: statistics.median(rows[key] for rows in rounds if key in rows) for key in keys}


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    if FLAGS.part in ("train", "both"):
        compare_training()
    if FLAGS.part in ("decode", "both"):
        compare_decoding()


if __name__ == "__main__":
    main()
