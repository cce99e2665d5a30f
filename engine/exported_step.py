"""The train step kept as a serialized `jax.export` beside JAX's compilation cache.

A warm start spends 1.1-1.4 s tracing and lowering the kjv_web_transformer's train step only to find
its compiled program in the cache (docs/performance.md, "A corpus of WMT14's size"). The step's
StableHLO, exported once and read back by the next run with the same code, settings and arguments,
is lowered in about 0.25 s. What decides the program is in the file's key: a digest of the project's
Python sources, the settings the step reads (`make_train_step`: the seed, the model, the
optimization, and the cluster's sharding), the libraries' versions, JAX's config, the devices and
each argument's shape, dtype and sharding. Other settings (paths, intervals, evaluation) leave the
key as it is, so runs that differ only in those share one export. A file that does not read back
is exported again, one that does not lower is removed; a step that cannot be exported (a host
callback, say), one whose export does not lower, and a run of several processes train with the
jitted step itself.

    step = exported_step.cached(jitted_step, settings, replicated)   # `jitted_step` where nothing is kept
    step.lower(state, batch).compile()                   # as a jitted function's
    state, metrics = step(state, batch)
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jaxlib
import optax
from jax import export

from run_setup.settings import Settings
from utils import files

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# In JAX's compilation cache folder: one file per key, the least recently used removed past EXPORTS_KEPT
EXPORTS = "attend_train_steps"
EXPORTS_KEPT = 64
# Packages of the project whose sources do not make a train step
NOT_THE_STEP = {"tests", "benchmarks", "tools"}


@functools.cache
def code_digest() -> str:
    """SHA-256 of the project's Python sources (their paths and bytes): the root's modules and its
    packages' (a folder with an `__init__.py`), but those of `NOT_THE_STEP`. An edit to any of them
    is another step. Taken when this module is imported (a few milliseconds), so that a file edited
    while a run prepares cannot put the old program under the new code's key."""
    digest = hashlib.sha256()
    packages = [
        folder
        for folder in PROJECT_ROOT.iterdir()
        if (folder / "__init__.py").is_file() and folder.name not in NOT_THE_STEP
    ]
    sources = [*PROJECT_ROOT.glob("*.py"), *(path for folder in packages for path in folder.rglob("*.py"))]
    for path in sorted(sources):
        digest.update(str(path.relative_to(PROJECT_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


code_digest()


def export_key(settings: Settings, arguments: Any) -> str:
    """What decides the step's program: the code, the settings the step reads, library versions,
    JAX's config, the devices, and the arguments' (a pytree of arrays) structure, shapes, dtypes
    and shardings."""
    leaves, structure = jax.tree.flatten(arguments)
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
        # per argument signature (structure, shapes, dtypes, shardings): its file's key, and the jitted
        # call of its export or None (the jitted step runs)
        self.keys: dict[Any, str] = {}
        self.calls: dict[str, Callable | None] = {}

    def _call_of(self, state: dict, batch: dict) -> tuple[str, Callable | None, list[jax.Array], Any]:
        """The key, the jitted call of the export (None: use the jitted step), the arguments' leaves
        (the state's first) and the state's tree: the arguments flattened once a call."""
        state_leaves, state_tree = jax.tree.flatten(state)
        batch_leaves, batch_tree = jax.tree.flatten(batch)
        leaves = state_leaves + batch_leaves
        signature = (state_tree, batch_tree, tuple((leaf.shape, leaf.dtype, leaf.sharding) for leaf in leaves))
        if signature not in self.keys:
            self.keys[signature] = export_key(self.settings, (state, batch))
        key = self.keys[signature]
        if key not in self.calls:
            exported = self._read(key) or self._export(key, state_tree, batch_tree, leaves)
            self.calls[key] = exported and jax.jit(
                exported.call,
                in_shardings=tuple(leaf.sharding for leaf in leaves),
                out_shardings=([leaf.sharding for leaf in state_leaves], self.replicated),
                donate_argnums=tuple(range(len(state_leaves))),
            )
        return key, self.calls[key], leaves, state_tree

    def _read(self, key: str) -> export.Exported | None:
        path = self.folder / key
        try:
            exported = export.deserialize(bytearray(path.read_bytes()))
        except FileNotFoundError:
            return None
        except Exception as error:  # noqa: BLE001 - a cache file that does not read back is made again
            logging.warning("%s does not read back as an exported train step (%s): exported again", path, error)
            return None
        # used now: the last to go (a read-only cache keeps its order)
        try:
            os.utime(path)
        except OSError:
            pass
        return exported

    def _export(self, key: str, state_tree: Any, batch_tree: Any, leaves: list[jax.Array]) -> export.Exported | None:
        count = state_tree.num_leaves

        def flat_step(*leaves):
            new_state, metrics = self.jitted(
                jax.tree.unflatten(state_tree, leaves[:count]), jax.tree.unflatten(batch_tree, leaves[count:])
            )
            return jax.tree.leaves(new_state), metrics

        try:
            exported = export.export(jax.jit(flat_step))(*leaves)
        except Exception as error:  # noqa: BLE001 - not every step exports (host callbacks): it runs jitted
            logging.info("the train step is not exported (%s): it is traced at every start", error)
            return None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            files.write_whole(self.folder / key, lambda temporary: temporary.write_bytes(exported.serialize()))
            keep_newest(self.folder, EXPORTS_KEPT)
        except Exception as error:  # noqa: BLE001 - a cache that cannot be written: this run goes on, unkept
            logging.info("the exported train step is not kept (%s)", error)
        return exported

    def lower(self, state: dict, batch: dict) -> jax.stages.Lowered:
        key, call, leaves, _ = self._call_of(state, batch)
        if call is not None:
            try:
                return call.lower(*leaves)
            except Exception as error:  # noqa: BLE001 - an export this JAX cannot lower: not kept, not used
                logging.warning("the exported train step %s does not lower (%s): the step is traced", key, error)
                (self.folder / key).unlink(missing_ok=True)
                self.calls[key] = None
        return self.jitted.lower(state, batch)

    def __call__(self, state: dict, batch: dict) -> tuple[dict, dict]:
        _, call, leaves, state_tree = self._call_of(state, batch)
        if call is None:
            return self.jitted(state, batch)
        state_leaves, metrics = call(*leaves)
        return jax.tree.unflatten(state_tree, state_leaves), metrics


def cached(jitted: Callable, settings: Settings, replicated: jax.sharding.Sharding) -> Callable:
    """`jitted` (the train step) through its kept export where a cache folder is set and the run is
    one process; `jitted` itself otherwise. `replicated`: where the metrics go."""
    folder = exports_folder()
    if folder is None or jax.process_count() > 1:
        return jitted
    return ExportedStep(jitted, settings, replicated, folder)
