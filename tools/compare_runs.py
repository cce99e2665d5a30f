"""Whether two run folders hold the same run: metrics rows (timing columns left out), evaluation
files, predictions and every array of the latest checkpoint, bit for bit (the arrays to a relative
tolerance with `--rtol`).

    python tools/compare_runs.py runs/A runs/B [--rtol=1e-5]

Bit for bit holds on one machine. XLA:CPU compiles for the CPU it runs on (its vector features and
cache sizes pick the kernels and their summation order), so the same run on another machine can end
with checkpoint arrays a few units in the last place apart: `--rtol` compares those as equal to
within `rtol` of each array's largest magnitude.

Prints what differs, one line each, and exits with 1 if anything does; with 0 and a summary if not.
It reads the folders only (no config, no model code, no devices: the checkpoint's arrays land in
host memory whatever devices or processes saved them), so runs written by different versions of
attend, or on different devices (8 against 1, a cluster's), compare alike.
"""

from __future__ import annotations

import json
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


def main(argv: list[str]) -> int:
    rtol = [float(arg.removeprefix("--rtol=")) for arg in argv[1:] if arg.startswith("--rtol=")]
    folders = [arg for arg in argv[1:] if not arg.startswith("--rtol=")]
    if len(folders) != 2 or len(rtol) > 1:
        print(__doc__.strip().splitlines()[4].strip(), file=sys.stderr)
        return 2
    differ, same = differences(Path(folders[0]), Path(folders[1]), rtol=rtol[0] if rtol else 0.0)
    for line in differ:
        print(f"differs: {line}")
    print(f"equal: {len(same)} items ({'; '.join(same[:1] + same[-1:])})" if not differ else f"{len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
