"""Training throughput of the default and the kjv_web configs on this machine.

    python benchmarks/train_throughput.py [--configs default,kjv_web_transformer] [--steps 60]
                                          [--config.data.batching=pack --config.batch_size=32 ...]

Overrides take train.py's syntax and apply to every config measured.

    python benchmarks/train_throughput.py --train_py [--steps 60]   # train.py's kjv_web_transformer against the peak
    python benchmarks/train_throughput.py --train_py --config.model.dtype=bfloat16   # its bfloat16 row
    python benchmarks/train_throughput.py --startup                 # first step, cold and warm

    python benchmarks/train_throughput.py --recurrent [--lengths 32,64,128,256] [--width 128]

times one train step (forward, backward, Adam) of RNNsearch and LSTMN (shallow and
deep fusion) at the same width on batches of 64 rows of source and target of each
length, and prints LSTMN's time as a multiple of RNNsearch's: the intra-attention
over the tapes makes an LSTMN step O(t), where RNNsearch's recurrence is O(1) per
step (both attend over the source).

For each config, in a fresh process: seconds from process start to the end of
the first train step (imports, data, tokenizer, model, compilation), the number
of compilations of the train step, steady-state steps/s and non-padding
tokens/s (median over windows of the real loop: pipeline, host-to-device,
step), and FLOP utilisation: XLA's cost analysis of the compiled step (FLOPs
per step) times steps/s, against this machine's float32 matmul peak, which the
script measures itself (median of repeated 2048^3 matmuls).

The figures measured with these commands, each with its command: docs/performance.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
from absl import flags  # noqa: E402

from benchmarks.timing import matmul_peak_flops  # noqa: E402
from run_setup import command_line  # noqa: E402
from run_setup.settings import parse  # noqa: E402


def measure(config_name: str, steps: int, window: int, overrides: list[str]) -> dict:
    """Runs in its own process (so that 'process start' is meaningful), set up as train.py's."""
    import train

    train.set_up_process()
    import jax

    from configs import base
    from engine import training_loop

    config = base.load(PROJECT_ROOT / "configs" / f"{config_name}.py", overrides)
    started = psutil.Process().create_time()
    with prepared_step(config) as (run, train_step, state, batches):
        first = run.global_batch(next(batches))
        flops = train_step.lower(state, first).compile().cost_analysis()["flops"]
        state, step_metrics = train_step(state, first)
        jax.block_until_ready(step_metrics)
        first_step_seconds = time.time() - started
        rates, token_rates, both_rates = [], [], []
        # as train.py's loop: at most two steps in flight
        queue = training_loop.StepQueue()
        for _ in range(steps // window):
            start, tokens, source_tokens = time.perf_counter(), 0.0, 0
            for _ in range(window):
                local = next(batches)
                # pad id 0
                source_tokens += int(np.count_nonzero(local["inputs"])) if local["inputs"].ndim == 2 else 0
                state, step_metrics = train_step(state, run.global_batch(local))
                queue.added(step_metrics)
                # stays on device
                tokens += step_metrics["tokens"]
            # waits for the window's last step
            tokens = float(tokens)
            elapsed = time.perf_counter() - start
            rates.append(window / elapsed)
            token_rates.append(tokens / elapsed)
            both_rates.append((tokens + source_tokens) / elapsed)
        compilations = train_step._cache_size()
    steps_per_second = statistics.median(rates) if rates else math.nan
    return {
        "config": config_name,
        "first_step_s": first_step_seconds,
        "compilations": compilations,
        "steps_per_s": steps_per_second,
        "tokens_per_s": statistics.median(token_rates) if token_rates else math.nan,
        "source_target_tokens_per_s": statistics.median(both_rates) if both_rates else math.nan,
        "step_gflop": flops / 1e9,
        "achieved_gflops": flops * steps_per_second / 1e9,
        "devices": jax.device_count(),
        "batch": (
            f"{config.batch_size} x {config.data.max_source_length}+{config.data.max_target_length} "
            f"({config.data.batching})"
        )
        + (f", {config.data.batch_tokens} tokens" if config.data.batch_tokens else ""),
    }


@contextlib.contextmanager
def prepared_step(config):
    """`(run, train_step, state, batches)` of `config` as train.py's loop builds them, in a temporary
    run folder: the jitted step (not yet compiled), the initial state and the training batches'
    iterator (host batches: `run.global_batch` puts one on the devices). Grain's iterator is closed
    and let go on the way out: held by a caller's variable until the interpreter's exit, its
    `__del__` ran after the modules it needs were torn down and printed a traceback."""
    import input_pipeline
    from engine import training_loop
    from run_setup.run import prepare_run

    with tempfile.TemporaryDirectory() as workdir:
        run = prepare_run(parse(config), workdir)
        tx = training_loop.make_optimizer(run.settings.optimization)
        state = training_loop.initial_state(run, tx)
        train_step = training_loop.compile_train_step(run, tx, state)
        data, _ = input_pipeline.train_dataset(run.task, run.tokens, run.settings.data, run.settings.source)
        batches = iter(data)
        handed = (batch for batch in batches)
        try:
            yield run, train_step, state, handed
        finally:
            handed.close()
            batches.close()


def recurrent_step_seconds(family: str, length: int, width: int, repeats: int, **fields) -> float:
    """Median seconds of a jitted train step of `family` on 64 rows of `length` source and target tokens."""
    from flax import nnx

    import models
    from benchmarks.timing import median_seconds, train_step_of

    sizes = dict(embed_dim=width, hidden_dim=width, attention_dim=width)
    if family == "rnnsearch":
        sizes["maxout_dim"] = width // 2
    model = models.create_model(family, rngs=nnx.Rngs(0), vocab_size=1000, **sizes, **fields)
    return median_seconds(*train_step_of(model, 1000, 64, length, seed=length), repeats)


def recurrent_table(lengths: list[int], width: int, repeats: int) -> None:
    print(
        f"train step of 64 rows, width {width} (embedding, hidden, attention), "
        f"source = target length; median of {repeats}"
    )
    print(
        "| tokens | RNNsearch s/step | LSTMN shallow s/step | LSTMN deep s/step | shallow / RNNsearch "
        "| deep / RNNsearch |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for length in lengths:
        rnnsearch = recurrent_step_seconds("rnnsearch", length, width, repeats)
        shallow = recurrent_step_seconds("lstmn", length, width, repeats, fusion="shallow", max_length=length + 1)
        deep = recurrent_step_seconds("lstmn", length, width, repeats, fusion="deep", max_length=length + 1)
        print(
            f"| {length} | {rnnsearch:.3f} | {shallow:.3f} | {deep:.3f} "
            f"| {shallow / rnnsearch:.2f}x | {deep / rnnsearch:.2f}x |",
            flush=True,
        )


# the Flax WMT example's kjv_web_transformer step, XLA's count (docs/performance.md)
REFERENCE_STEP_FLOP = 412.7e9


def train_py_check(steps: int, overrides: list[str]) -> None:
    """The Transformer throughput check of docs/performance.md: a `steps`-step train.py run of
    kjv_web_transformer logging every 10 steps; the median steps_per_second of its train rows from
    step 20 on, times the reference's FLOP per step, against the matmul rate of the run's compute
    dtype (float32 unless `model.dtype` says bfloat16) measured in the same run (before and after
    it); the other dtype's rate is printed too."""
    import input_pipeline
    from configs import base
    from run_setup.run import prepare_run

    config = base.load(PROJECT_ROOT / "configs" / "kjv_web_transformer.py", overrides)
    # the peak the step is held against: float32's, or bfloat16's for a bfloat16 run
    dtype = config.model.dtype
    before = [matmul_peak_flops(dtype=dtype) for _ in range(3)]
    with tempfile.TemporaryDirectory() as workdir:
        command = [
            sys.executable,
            "train.py",
            "--config=configs/kjv_web_transformer.py",
            f"--workdir={workdir}",
            f"--config.num_train_steps={steps}",
            "--config.log_every_steps=10",
            "--config.eval_every_steps=100000",
            "--config.checkpoint_every_steps=100000",
            "--config.eval_decode_examples=8",
            *overrides,
        ]
        subprocess.run(command, cwd=PROJECT_ROOT, check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
        # the run's own vocabulary: the same batches, to count their tokens
        run = prepare_run(parse(config), workdir)
        batches = iter(input_pipeline.train_dataset(run.task, run.tokens, run.settings.data, run.settings.source)[0])
        counts = [
            (int((b["inputs"] > 0).sum()), int((b["targets"] > 0).sum())) for b in (next(batches) for _ in range(20))
        ]
    after = [matmul_peak_flops(dtype=dtype) for _ in range(3)]
    peak = statistics.median(before + after)
    other = "bfloat16" if dtype == "float32" else "float32"
    other_peak = statistics.median(matmul_peak_flops(dtype=other) for _ in range(3))
    train = [r for r in rows if r["split"] == "train" and r["step"] >= 20]
    steps_per_second = statistics.median(r["steps_per_second"] for r in train)
    source, target = (statistics.mean(c[i] for c in counts) for i in (0, 1))
    print(
        f"{dtype} matmul peak (2048^3; medians before {statistics.median(before) / 1e9:.0f}, after "
        f"{statistics.median(after) / 1e9:.0f}): {peak / 1e9:.0f} GFLOP/s; {other} after them: "
        f"{other_peak / 1e9:.0f} GFLOP/s"
    )
    print(
        "| run | steps/s (median of rows >= 20) | s/step | source+target tok/s | target tok/s "
        "| reference FLOP x steps/s / peak |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| train.py kjv_web_transformer, {steps} steps {' '.join(overrides)} | {steps_per_second:.3f} | "
        f"{1 / steps_per_second:.2f} | {steps_per_second * (source + target):,.0f} | "
        f"{steps_per_second * target:,.0f} | {REFERENCE_STEP_FLOP * steps_per_second / peak:.3f} |"
    )


def startup_check(overrides: list[str]) -> None:
    """Seconds from process start to the first step done on kjv_web_transformer, cold (no compiled
    programs, no tokenized arrays or shelved vocabulary; the data built) and warm (a second run in
    a new workdir), each with its number of train step compilations."""
    import shutil

    import tasks
    from configs import base

    config = base.load(PROJECT_ROOT / "configs" / "kjv_web_transformer.py", overrides)
    task = tasks.load_task(
        config.task.name, config.data_dir, **{k: v for k, v in config.task.to_dict().items() if k != "name"}
    )
    built = Path(task.splits["train"].shards[0]).parent
    print("| start | first step done, s from process start | train step compilations |")
    print("|---|---:|---:|")
    with tempfile.TemporaryDirectory() as cache:
        for start in ("cold", "warm"):
            if start == "cold":
                for folder in ("tokenized", "vocabularies"):
                    shutil.rmtree(built / folder, ignore_errors=True)
            command = [sys.executable, __file__, "--one", "kjv_web_transformer", "--steps", "0", *overrides]
            environment = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache}
            output = subprocess.run(
                command, cwd=PROJECT_ROOT, env=environment, capture_output=True, text=True, check=True
            ).stdout
            r = json.loads(output.strip().splitlines()[-1])
            print(f"| {start} | {r['first_step_s']:.1f} | {r['compilations']} |", flush=True)


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("configs", "default,kjv_web_transformer", "", flag_values=FLAGS)
flags.DEFINE_integer("steps", 60, "steady-state steps measured per config", flag_values=FLAGS)
flags.DEFINE_integer("window", 10, "steps per timing window", flag_values=FLAGS)
flags.DEFINE_bool("recurrent", False, "RNNsearch and LSTMN train steps against length", flag_values=FLAGS)
flags.DEFINE_string("lengths", "32,64,128,256", "--recurrent: the lengths", flag_values=FLAGS)
flags.DEFINE_integer("width", 128, "--recurrent: embedding, hidden and attention size", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 5, "--recurrent: timed steps per model and length", flag_values=FLAGS)
flags.DEFINE_bool(
    "train_py",
    False,
    "a train.py run of kjv_web_transformer against the matmul peak (docs/performance.md)",
    flag_values=FLAGS,
)
flags.DEFINE_bool("startup", False, "kjv_web_transformer's start-up, cold and warm", flag_values=FLAGS)
flags.DEFINE_string("one", None, "internal: measure one config in this process", flag_values=FLAGS)


def main() -> None:
    # the rest: --config.a.b=value overrides
    overrides = command_line.parse(FLAGS, sys.argv, __doc__, overrides=True)
    args = FLAGS
    if args.train_py:
        train_py_check(args.steps, overrides)
        return
    if args.startup:
        startup_check(overrides)
        return
    if args.recurrent:
        recurrent_table([int(n) for n in args.lengths.split(",")], args.width, args.repeats)
        return
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.window, overrides)))
        return

    peak = matmul_peak_flops()
    print(f"float32 matmul peak of this machine (2048^3, median of 10): {peak / 1e9:.1f} GFLOP/s\n")
    print(
        "| config | batch | first step s | compilations | steps/s | non-pad source+target tokens/s | target tokens/s | "
        "GFLOP/step | achieved GFLOP/s | of peak |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.configs.split(","):
        command = [sys.executable, __file__, "--one", name, "--steps", str(args.steps), "--window", str(args.window)]
        command += overrides
        output = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout
        r = json.loads(output.strip().splitlines()[-1])
        print(
            f"| {r['config']} | {r['batch']} | {r['first_step_s']:.1f} | {r['compilations']} | "
            f"{r['steps_per_s']:.2f} | {r['source_target_tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
            f"{r['step_gflop']:.2f} | {r['achieved_gflops']:.1f} | {100 * r['achieved_gflops'] * 1e9 / peak:.0f}% |",
            flush=True,
        )


if __name__ == "__main__":
    from utils import allocator

    # as train.py runs (the imports above are paid twice)
    allocator.restart_with_huge_pages(__file__)
    main()
