"""Whether two run folders hold the same run: metrics rows (timing columns left out), evaluation
files, predictions and every array of the latest checkpoint, bit for bit (the arrays to a relative
tolerance with `--rtol`).

    python tools/compare_runs.py runs/A runs/B [--rtol=1e-5]
    python tools/compare_runs.py runs/A runs/B --curves     # how far apart their training curves are

Bit for bit holds on one machine. XLA:CPU compiles for the CPU it runs on (its vector features and
cache sizes pick the kernels and their summation order), so the same run on another machine can end
with checkpoint arrays a few units in the last place apart: `--rtol` compares those as equal to
within `rtol` of each array's largest magnitude.

Prints what differs, one line each, and exits with 1 if anything does; with 0 and a summary if not.
With `--curves`, for two runs that are not meant to be the same (float32 against bfloat16, two
versions of a model) it prints instead, for each metric of the train rows that both log at the
same steps, the largest relative gap `|B - A| / |A|` over those steps and the step where it lies.
It reads the folders only (no config, no model code, no devices: the checkpoint's arrays land in
host memory whatever devices or processes saved them), so runs written by different versions of
attend, or on different devices (8 against 1, a cluster's), compare alike.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

# Columns that measure the machine, not the run.
TIMING_COLUMNS = frozenset({"tokens_per_second", "steps_per_second"})


def metric_rows(workdir: Path) -> list[dict]:
    """`metrics.jsonl` of `workdir`, each row without its timing columns."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{key: value for key, value in row.items() if key not in TIMING_COLUMNS} for row in rows]


def without_timing(tree):
    """A JSON tree with every timing column left out, at any depth."""
    if isinstance(tree, dict):
        return {key: without_timing(value) for key, value in tree.items() if key not in TIMING_COLUMNS}
    if isinstance(tree, list):
        return [without_timing(value) for value in tree]
    return tree


def latest_checkpoint_arrays(workdir: Path) -> tuple[int, dict[str, np.ndarray]]:
    """The latest checkpoint's step and its train state's arrays, by their path in the tree."""
    import jax
    import orbax.checkpoint as ocp

    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    directory = (workdir / "checkpoints" / str(steps[-1]) / "state").absolute()
    checkpointer = ocp.PyTreeCheckpointer()
    # NumPy arrays on the host: no device to place them on, so Orbax looks up no saved sharding. On
    # the saved shardings a run of 8 devices (or several processes) did not restore at all in a
    # process of one, and elsewhere Orbax warned that restoring onto them is unsafe.
    as_numpy = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), checkpointer.metadata(directory).item_metadata.tree
    )
    state = checkpointer.restore(directory, restore_args=as_numpy)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    return steps[-1], {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def arrays_equal(first: np.ndarray, second: np.ndarray, rtol: float) -> bool:
    """Bit for bit where `rtol` is 0 and for integer and boolean arrays (counts, keys, flags); else
    each entry within `rtol` of its own size plus `rtol` of the array's largest (entries near 0,
    such as Adam's moments, move by the array's rounding)."""
    if rtol == 0 or not np.issubdtype(first.dtype, np.inexact):
        return np.array_equal(first, second)
    scale = float(np.abs(first).max()) if first.size else 0.0
    return first.shape == second.shape and np.allclose(second, first, rtol=rtol, atol=rtol * scale)


def differences(first: Path, second: Path, rtol: float = 0.0) -> tuple[list[str], list[str]]:
    """What differs between run folders `first` and `second`, and what was found equal (the
    checkpoint's arrays to `rtol`: `arrays_equal`)."""
    differ, same = [], []
    rows = metric_rows(first), metric_rows(second)
    (same if rows[0] == rows[1] else differ).append(f"metrics.jsonl: {len(rows[0])} and {len(rows[1])} rows")
    for folder, pattern in (("eval", "*.json"), ("predictions", "*.tsv")):
        names = sorted({p.name for run in (first, second) for p in (run / folder).glob(pattern)})
        for name in names:
            paths = [run / folder / name for run in (first, second)]
            if not all(path.exists() for path in paths):
                differ.append(f"{folder}/{name}: in one run only")
                continue
            if pattern == "*.json":
                equal = without_timing(json.loads(paths[0].read_text())) == without_timing(
                    json.loads(paths[1].read_text())
                )
            else:
                equal = paths[0].read_bytes() == paths[1].read_bytes()
            (same if equal else differ).append(f"{folder}/{name}")
    (step, arrays), (other_step, other_arrays) = latest_checkpoint_arrays(first), latest_checkpoint_arrays(second)
    if step != other_step or arrays.keys() != other_arrays.keys():
        differ.append(
            f"checkpoints: step {step} with {len(arrays)} arrays, step {other_step} with {len(other_arrays)} arrays"
        )
    else:
        unequal = [key for key in arrays if not arrays_equal(arrays[key], other_arrays[key], rtol)]
        differ.extend(f"checkpoint {step}: {key}" for key in unequal)
        if not unequal:
            same.append(f"checkpoint {step}: {len(arrays)} arrays")
    return differ, same


def curve_gaps(first: Path, second: Path, split: str = "train") -> dict[str, tuple[float, int, int]]:
    """Each numeric metric of the `split` rows that both runs log at a step:
    `(largest |second - first| / |first| over those steps (the absolute gap where first is 0; inf
    where one is NaN), its step, the steps compared)`."""
    rows = [{row["step"]: row for row in metric_rows(run) if row.get("split") == split} for run in (first, second)]
    steps = sorted(rows[0].keys() & rows[1].keys())
    gaps = {}
    for name in sorted({name for step in steps for name in rows[0][step]} - {"step", "split"}):
        pairs = [
            (rows[0][step][name], rows[1][step][name], step)
            for step in steps
            if isinstance(rows[0][step].get(name), (int, float)) and isinstance(rows[1][step].get(name), (int, float))
        ]
        if pairs:
            gap, step = max((relative_gap(a, b), step) for a, b, step in pairs)
            gaps[name] = (gap, step, len(pairs))
    return gaps


def relative_gap(first: float, second: float) -> float:
    """`|second - first| / |first|`, the absolute gap where `first` is 0, inf where either is NaN (a
    NaN would drop out of `max`)."""
    gap = abs(second - first) / abs(first) if first else abs(second - first)
    return math.inf if math.isnan(gap) else gap


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--rtol", type=float, default=0.0, help="checkpoint arrays equal to this tolerance")
    parser.add_argument("--curves", action="store_true", help="the train metrics' largest relative gaps instead")
    args = parser.parse_args(argv[1:])
    if args.curves and args.rtol:
        parser.error("--rtol is for runs meant to be the same; --curves compares runs that are not")
    if args.curves:
        print("| train metric | largest relative gap | at step | steps compared |\n|---|---:|---:|---:|")
        for name, (gap, step, count) in curve_gaps(args.first, args.second).items():
            print(f"| {name} | {gap:.4%} | {step} | {count} |")
        return 0
    differ, same = differences(args.first, args.second, rtol=args.rtol)
    for line in differ:
        print(f"differs: {line}")
    print(f"equal: {len(same)} items ({'; '.join(same[:1] + same[-1:])})" if not differ else f"{len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
