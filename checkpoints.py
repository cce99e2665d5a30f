"""Checkpoints: one Orbax CheckpointManager over the train state and the data iterator.

Each checkpoint holds the train state (step, parameters, optimizer state; the
dropout RNG is a function of seed and step) and the Grain iterator state, so a
resumed run sees exactly the batches an uninterrupted run would. Orbax writes
each checkpoint to a temporary folder and renames it when complete, so a
crash mid-save leaves no partial checkpoint; a checkpoint that is complete but
unreadable (a damaged file) is reported and the previous one is used.

Kept: the last `keep` checkpoints, and the best one by an eval metric.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grain
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers


class Checkpoints:
    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        best_metric: str = "loss",
        larger_is_better: bool = False,
        async_save: bool = True,
    ):
        self.best_metric = best_metric
        policies = [checkpoint_managers.LatestN(n=max(keep, 1))]
        policies.append(
            checkpoint_managers.BestN(
                get_metric_fn=lambda metrics: metrics[best_metric],
                reverse=not larger_is_better,  # BestN sorts ascending and keeps the last n
                n=1,
                keep_checkpoints_without_metrics=False,
            )
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
            best_fn=lambda metrics: metrics[best_metric],
            best_mode="max" if larger_is_better else "min",
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # leftovers of a save cut short
        )
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=("state", "data"))
        # Orbax removes leftovers in a background thread; an error right after (a bad
        # data setting) would exit under it and print its traceback. Let it finish now.
        cleanup = getattr(self.manager, "_cleanup_tmp_directory_future", None)
        if cleanup is not None:
            cleanup.result()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def save(self, step: int, state: Any, data_iterator: Any | None, metrics: dict | None = None) -> None:
        """Saves (asynchronously); `metrics` holding `best_metric` make it a candidate for best."""
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        usable = metrics if metrics and self.best_metric in metrics else None
        self.manager.save(step, args=ocp.args.Composite(**items), metrics=usable, force=True)

    def restore(
        self, abstract_state: Any, data_iterator: Any | None = None, *, step: int | None = None
    ) -> tuple[int, Any]:
        """Restores `step`, or the newest readable checkpoint (warning about any that is not).

        `data_iterator`, when given, is set to the saved position.

        Raises:
          FileNotFoundError: no checkpoint (or not the asked step).
          RuntimeError: the asked step, or every checkpoint, is unreadable.
        """
        available = self.steps()
        if step is not None and step not in available:
            raise FileNotFoundError(f"no checkpoint at step {step} in {self.manager.directory}; have {available}")
        candidates = [step] if step is not None else available[::-1]
        if not candidates:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        for candidate in candidates:
            items = {"state": ocp.args.StandardRestore(abstract_state)}
            if data_iterator is not None:
                items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
            try:
                restored = self.manager.restore(candidate, args=ocp.args.Composite(**items))
            except Exception as error:  # Orbax/TensorStore raise many types for damaged files
                logging.warning("checkpoint at step %d in %s is unreadable (%s: %s)", candidate,
                                self.manager.directory, type(error).__name__, str(error).splitlines()[0][:300])
                if step is not None:
                    raise RuntimeError(f"checkpoint at step {step} is unreadable: {error}") from error
                continue
            if candidate != candidates[0]:
                logging.warning("fell back to the checkpoint at step %d", candidate)
            return candidate, restored["state"]
        raise RuntimeError(f"no readable checkpoint in {self.manager.directory} (tried steps {candidates})")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
