"""Restoring a Transformer-big-sized checkpoint with and without checking its files' SHA-256 digest.

    python benchmarks/checkpoint_restore_speed.py [--params 214_000_000] [--repeats 3]

Saves one checkpoint of a train state the size of `configs/wmt14_transformer.py:big`'s (214M
float32 parameters and Adam's two moments: 2.6 GB) in a temporary folder, then restores it
`--repeats` times each way, alternating, and prints the medians and the check's share. The check
hashes the files by BLAKE3 in a thread while Orbax reads them (checkpoints.Checkpoints._verified_restore);
the table also gives what hashing alone takes, by BLAKE3 and by SHA-256 (a check made before the
restore, reading every file once more, adds that).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags  # noqa: E402

from run_setup import command_line  # noqa: E402
from run_setup.checkpoints import Checkpoints  # noqa: E402
from utils import files  # noqa: E402

# parameters per array: a 2048 x 2048 matrix, the size of Transformer-big's larger blocks
LAYER = 4_194_304


def train_state(parameters: int) -> dict:
    """`{"step", "params", "opt_state": (mu, nu)}` of `parameters` random float32 parameters in arrays of
    LAYER (random: Orbax compresses what it writes, and constant arrays would shrink to nothing)."""
    sizes = [LAYER] * (parameters // LAYER) + ([parameters % LAYER] if parameters % LAYER else [])
    keys = jax.random.split(jax.random.key(0), len(sizes))
    params = {
        f"w{i}": 0.02 * jax.random.normal(key, (size,), jnp.float32) for i, (key, size) in enumerate(zip(keys, sizes))
    }
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": (params, jax.tree.map(jnp.square, params))}


# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_integer("params", 214_000_000, "", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 3, "", flag_values=FLAGS)


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    args = FLAGS
    state = train_state(args.params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    gigabytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / 1e9
    with tempfile.TemporaryDirectory(dir=PROJECT_ROOT) as folder:
        writer = Checkpoints(Path(folder) / "checkpoints", async_save=False)
        writer.save(1, state, None)
        # writes the digest
        writer.close()
        del state
        reader = Checkpoints(Path(folder) / "checkpoints")
        times = {True: [], False: [], "hashing": [], "sha256": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            # hashing alone: what a check before the restore adds
            assert reader._damage(1) is None
            times["hashing"].append(time.perf_counter() - start)
            start = time.perf_counter()
            # the same files by SHA-256
            files.file_digests(Path(folder) / "checkpoints" / "1", algorithm="sha256")
            times["sha256"].append(time.perf_counter() - start)
            for verify in (False, True):
                start = time.perf_counter()
                _, restored = reader.restore(abstract, verify=verify)
                jax.block_until_ready(restored)
                times[verify].append(time.perf_counter() - start)
                del restored
        reader.close()
    plain, checked, hashing, sha = (statistics.median(times[key]) for key in (False, True, "hashing", "sha256"))
    print(
        f"| checkpoint | restore s (median of {args.repeats}) | with the check (BLAKE3 while reading) s | its share | "
        "BLAKE3 alone s | SHA-256 alone s (a SHA-256 check before the restore) | its share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.params / 1e6:.0f}M parameters + Adam, {gigabytes:.2f} GB | {plain:.2f} | {checked:.2f} | "
        f"{(checked - plain) / plain:.2f} | {hashing:.2f} | {sha:.2f} | {sha / plain:.2f} |"
    )


if __name__ == "__main__":
    main()
