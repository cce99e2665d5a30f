"""Where a train step's time goes, per XLA operation: the profile behind issue 44's training figures.

    python benchmarks/step_profile.py [--config kjv_web_transformer] [--steps 2] [--top 15] [--config.a.b=v ...]

Builds the step as train.py's loop does (`train_throughput.prepared_step`), runs three steps
untimed, times five (the median is the step's wall time), then runs `--steps` more under
`jax.profiler` and matches each traced event to its instruction in the compiled program. Prints,
beside this machine's float32 matmul rate measured in the same process:

- the matrix products' FLOP per step (counted from the program's shapes), their time and the rate
  they run at, forward and backward apart (an instruction whose op_name holds `transpose(` is the
  backward pass's), and what the products alone would take at the measured matmul rate;
- the other operations grouped by the primitive their op_name ends in (`exp`, `reduce_sum`, ...);
- the `--top` instructions by time, each with its output shape, op_name and rate.

An instruction's time is its traced event's. XLA:CPU's own dots hand their work to a thread pool
and close their event before it is done, so the table is as good as the share of the wall time the
events cover, which it prints; XNNPACK's fusions (`ynn_fusion`, which run the products in the
pinned jaxlib) are timed whole.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
from absl import flags  # noqa: E402

from benchmarks.timing import matmul_peak_flops  # noqa: E402
from run_setup import command_line  # noqa: E402

FLAGS = flags.FlagValues()
flags.DEFINE_string("config", "kjv_web_transformer", "configs/NAME.py", flag_values=FLAGS)
flags.DEFINE_integer("steps", 2, "steps traced", flag_values=FLAGS)
flags.DEFINE_integer("top", 15, "instructions listed", flag_values=FLAGS)

# instructions that hold others (their events span their bodies' events)
CONTAINERS = ("while", "call", "conditional")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    op_name: str
    flop: int


def parse_program(text: str) -> dict[str, Instruction]:
    """Every instruction of a compiled program's text, by name, with the FLOP of the products it
    computes (a fusion's: those of the computation it calls)."""
    lines, shapes, bodies = {}, {}, {}
    computation, body = None, []
    for line in text.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            computation, body = line.split(" ", 1)[0].lstrip("%"), []
            if computation == "ENTRY":
                computation = line.split(" ", 2)[1].lstrip("%")
        elif line.startswith("}"):
            bodies[computation] = body
        elif match := INSTRUCTION.match(line):
            lines[match.group(1)] = match
            shapes[match.group(1)] = match.group(2)
            body.append(match.group(1))
    instructions = {}
    for name, match in lines.items():
        rest = match.group(4)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        called = re.search(r"calls=%([\w.\-]+)", rest)
        members = bodies.get(called.group(1), []) if called else [name]
        flop = sum(dot_flop(lines[m], shapes) for m in members if lines[m].group(3) == "dot")
        instructions[name] = Instruction(
            name, match.group(2), match.group(3), op_name.group(1) if op_name else "", flop
        )
    return instructions


def dims(shape: str) -> list[int]:
    """`f32[2048,256]{1,0}` -> [2048, 256]."""
    match = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def dot_flop(match: re.Match, shapes: dict[str, str]) -> int:
    """2 x the output's elements x the contracted size, from a dot's line."""
    rest = match.group(4)
    lhs = re.match(r"[^%]*%([\w.\-]+)", rest).group(1)
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
    lhs_dims = dims(shapes[lhs])
    return 2 * math.prod(dims(match.group(2))) * math.prod(lhs_dims[int(d)] for d in contracting.split(",") if d)


def traced_microseconds(trace: dict | list, instructions: dict[str, Instruction]) -> tuple[dict, dict]:
    """Total event time and event count per instruction (containers left out)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = collections.Counter(), collections.Counter()
    for event in events:
        instruction = instructions.get(event.get("name"))
        if event.get("ph") == "X" and instruction and instruction.opcode not in CONTAINERS:
            total[event["name"]] += event["dur"]
            count[event["name"]] += 1
    return total, count


def kind(instruction: Instruction) -> str:
    """The products by pass; anything else by the primitive its op_name ends in."""
    if instruction.flop:
        return "matrix products, backward" if "transpose(" in instruction.op_name else "matrix products, forward"
    primitive = re.sub(r"\(.*", "", instruction.op_name.rsplit("/", 1)[-1]) if instruction.op_name else ""
    return primitive or instruction.opcode


def profile(config_name: str, steps: int, overrides: list[str]) -> tuple[float, dict, str]:
    """`(median wall seconds a step, the trace, the program's text)`."""
    import train

    train.set_up_process()
    import jax

    from benchmarks.train_throughput import prepared_step
    from configs import base

    config = base.load(PROJECT_ROOT / "configs" / f"{config_name}.py", overrides)
    with prepared_step(config) as (run, train_step, state, batches):
        program = train_step.lower(state, run.global_batch(next(batches))).compile().as_text()
        seconds = []
        for step in range(8):
            batch = run.global_batch(next(batches))
            start = time.perf_counter()
            state, step_metrics = train_step(state, batch)
            jax.block_until_ready(step_metrics)
            if step >= 3:
                seconds.append(time.perf_counter() - start)

        def traced_steps():
            nonlocal state
            for _ in range(steps):
                state, step_metrics = train_step(state, run.global_batch(next(batches)))
                jax.block_until_ready(step_metrics)

        trace = recorded_trace(traced_steps)
    return statistics.median(seconds), trace, program


def recorded_trace(run: Callable[[], None]) -> dict:
    """The trace `jax.profiler` records while `run()` runs (its perfetto JSON)."""
    import jax

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            run()
        (path,) = glob.glob(f"{folder}/**/*perfetto_trace.json.gz", recursive=True)
        return json.load(gzip.open(path))


def main() -> None:
    overrides = command_line.parse(FLAGS, sys.argv, __doc__, overrides=True)
    args = FLAGS
    peak = statistics.median(matmul_peak_flops() for _ in range(3))
    wall, trace, program = profile(args.config, args.steps, overrides)
    instructions = parse_program(program)
    total, count = traced_microseconds(trace, instructions)
    per_step = {name: us / 1e6 / args.steps for name, us in total.items()}
    traced = sum(per_step.values())
    flop = {name: instructions[name].flop * count[name] / args.steps for name in per_step}
    print(
        f"{args.config} {' '.join(overrides)}: {wall:.2f} s a step (median of 5, outside the profiler); "
        f"traced operations {traced:.2f} s a step ({traced / wall:.0%} of it); float32 matmul rate "
        f"{peak / 1e9:.0f} GFLOP/s (2048^3, median of 3)\n"
    )
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for name in per_step:
        groups[kind(instructions[name])].append(name)
    print("| operations | s a step | share of traced | GFLOP a step | GFLOP/s | at the matmul rate |")
    print("|---|---:|---:|---:|---:|---:|")
    for group, names in sorted(groups.items(), key=lambda item: -sum(per_step[n] for n in item[1]))[: args.top]:
        seconds, group_flop = sum(per_step[n] for n in names), sum(flop[n] for n in names)
        rate = f"{group_flop / seconds / 1e9:.0f}" if group_flop else ""
        floor = f"{group_flop / peak:.2f} s" if group_flop else ""
        print(
            f"| {group} ({len(names)}) | {seconds:.3f} | {seconds / traced:.1%} | "
            f"{group_flop / 1e9:.1f} | {rate} | {floor} |"
        )
    all_flop = sum(flop.values())
    print(f"\nall products: {all_flop / 1e9:.1f} GFLOP a step, {all_flop / peak:.2f} s at the matmul rate\n")
    print("| instruction | runs a step | s a step | output | GFLOP/s | op_name |")
    print("|---|---:|---:|---|---:|---|")
    for name in sorted(per_step, key=per_step.get, reverse=True)[: args.top]:
        instruction = instructions[name]
        rate = f"{flop[name] / per_step[name] / 1e9:.0f}" if flop[name] else ""
        print(
            f"| {name} | {count[name] // args.steps} | {per_step[name]:.3f} | {instruction.shape} | {rate} "
            f"| {instruction.op_name.removeprefix('jit(train_step)/')[-70:]} |"
        )


if __name__ == "__main__":
    from utils import allocator

    # as train.py runs
    allocator.restart_with_huge_pages(__file__)
    main()
