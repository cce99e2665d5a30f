"""The train step kept as a serialized `jax.export` beside JAX's compilation cache.

A warm start spends 1.1-1.4 s tracing and lowering the kjv_web_transformer's train step only to find
its compiled program in the cache (docs/performance.md, "A corpus of WMT14's size"). The step's
StableHLO, exported once and read back by the next run with the same code, settings and arguments,
is lowered in about 0.25 s. What decides the program is in the file's key: a digest of the project's
Python sources, the settings the step reads (`make_train_step`: the seed, the model, the
optimization, and the cluster's sharding), the libraries' versions, JAX's config, the devices and
each argument's shape, dtype and sharding. Other settings (paths, intervals, evaluation) leave the
key as it is, so runs that differ only in those share one export. A run whose step cannot be
exported (a host callback, say), a file that does not read back, or a run of several processes
trains with the jitted step itself.

    step = exported_step.cached(jitted_step, settings, replicated)   # `jitted_step` where nothing is kept
    step.lower(state, batch).compile()                   # as a jitted function's
    state, metrics = step(state, batch)
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax import export

from run_setup.settings import Settings
from utils import files

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# In JAX's compilation cache folder: one file per key, the least recently used removed past EXPORTS_KEPT
EXPORTS = "attend_train_steps"
EXPORTS_KEPT = 64
# Folders of the project whose sources do not make a train step
NOT_THE_STEP = {"tests", "benchmarks", "tools", "docs", "data"}


@functools.cache
def code_digest() -> str:
    """SHA-256 of the project's Python sources (their paths and bytes): an edit to any of them is
    another step. Once a process (0.01 s)."""
    digest = hashlib.sha256()
    for path in sorted(PROJECT_ROOT.rglob("*.py")):
        relative = path.relative_to(PROJECT_ROOT)
        if relative.parts[0].startswith(".") or relative.parts[0] in NOT_THE_STEP:
            continue
        digest.update(str(relative).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def export_key(settings: Settings, arguments: Any) -> str:
    """What decides the step's program: the code, the settings the step reads, library versions,
    JAX's config, the devices, and the arguments' (a pytree of arrays) structure, shapes, dtypes
    and shardings."""
    leaves, structure = jax.tree.flatten(arguments)
    import flax
    import jaxlib
    import optax

    facts = [
        code_digest(),
        repr((settings.seed, settings.model, settings.optimization, settings.cluster)),
        [jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__],
        sorted((name, repr(value)) for name, value in jax.config.values.items()),
        [str(device) for device in jax.devices()],
        str(structure),
        [(leaf.shape, str(leaf.dtype), repr(leaf.sharding)) for leaf in leaves],
    ]
    return hashlib.sha256(json.dumps(facts, default=list).encode()).hexdigest()


def exports_folder() -> Path | None:
    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) / EXPORTS if folder else None


def keep_newest(folder: Path, count: int) -> None:
    """Removes all but the `count` most recently used files of `folder` (a read touches its file)."""
    kept = sorted(folder.iterdir(), key=lambda path: path.stat().st_mtime, reverse=True)
    for path in kept[count:]:
        path.unlink(missing_ok=True)


class ExportedStep:
    """`step(state, batch) -> (state, metrics)` through the exported program of each argument
    signature (read from the folder, or exported and written there), the state donated and the
    outputs placed as the jitted step's (`state` in its own shardings, the metrics `replicated`).
    Where the step cannot be exported, the jitted step runs."""

    def __init__(self, jitted: Callable, settings: Settings, replicated: jax.sharding.Sharding, folder: Path):
        self.jitted, self.settings, self.replicated, self.folder = jitted, settings, replicated, folder
        # per argument signature: the jitted call of its export, or None where it cannot be exported
        self.calls: dict[str, Callable | None] = {}

    def _call_of(self, state: dict, batch: dict) -> tuple[Callable | None, list[jax.Array]]:
        """The jitted call of the export for these arguments (None: use the jitted step), and the
        arguments' leaves."""
        state_leaves = jax.tree.leaves(state)
        leaves = state_leaves + jax.tree.leaves(batch)
        key = export_key(self.settings, (state, batch))
        if key not in self.calls:
            exported = self._read(key) or self._export(key, state, batch)
            self.calls[key] = exported and jax.jit(
                exported.call,
                in_shardings=tuple(leaf.sharding for leaf in leaves),
                out_shardings=([leaf.sharding for leaf in state_leaves], self.replicated),
                donate_argnums=tuple(range(len(state_leaves))),
            )
        return self.calls[key], leaves

    def _read(self, key: str) -> export.Exported | None:
        path = self.folder / key
        try:
            exported = export.deserialize(bytearray(path.read_bytes()))
            path.touch()
            return exported
        except FileNotFoundError:
            return None
        except Exception as error:  # noqa: BLE001 - a cache file that does not read back is made again
            logging.warning("%s does not read back as an exported train step (%s): exported again", path, error)
            return None

    def _export(self, key: str, state: dict, batch: dict) -> export.Exported | None:
        state_tree, batch_tree = jax.tree.structure(state), jax.tree.structure(batch)
        count = state_tree.num_leaves

        def flat_step(*leaves):
            new_state, metrics = self.jitted(
                jax.tree.unflatten(state_tree, leaves[:count]), jax.tree.unflatten(batch_tree, leaves[count:])
            )
            return jax.tree.leaves(new_state), metrics

        try:
            exported = export.export(jax.jit(flat_step))(*jax.tree.leaves(state), *jax.tree.leaves(batch))
        except Exception as error:  # noqa: BLE001 - not every step exports (host callbacks): it runs jitted
            logging.info("the train step is not exported (%s): it is traced at every start", error)
            return None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            files.write_whole(self.folder / key, lambda temporary: temporary.write_bytes(exported.serialize()))
            keep_newest(self.folder, EXPORTS_KEPT)
        except OSError as error:
            logging.debug("the exported train step is not kept: %s", error)
        return exported

    def lower(self, state: dict, batch: dict) -> jax.stages.Lowered:
        call, leaves = self._call_of(state, batch)
        return self.jitted.lower(state, batch) if call is None else call.lower(*leaves)

    def __call__(self, state: dict, batch: dict) -> tuple[dict, dict]:
        call, leaves = self._call_of(state, batch)
        if call is None:
            return self.jitted(state, batch)
        state_leaves, metrics = call(*leaves)
        return jax.tree.unflatten(jax.tree.structure(state), state_leaves), metrics


def cached(jitted: Callable, settings: Settings, replicated: jax.sharding.Sharding) -> Callable:
    """`jitted` (the train step) through its kept export where a cache folder is set and the run is
    one process; `jitted` itself otherwise. `replicated`: where the metrics go."""
    folder = exports_folder()
    if folder is None or jax.process_count() > 1:
        return jitted
    return ExportedStep(jitted, settings, replicated, folder)
