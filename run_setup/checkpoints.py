"""Checkpoints: one Orbax CheckpointManager over the train state and the data iterator.

Each checkpoint holds the train state (step, parameters, optimizer state; the
dropout RNG is a function of seed and step) and the Grain iterator state, so a
resumed run sees exactly the batches an uninterrupted run would. Orbax writes
each checkpoint to a temporary folder and renames it when complete, so a
crash mid-save leaves no partial checkpoint; a checkpoint that is complete but
unreadable (a damaged file) is reported and the previous one is used. Each
checkpoint holds a digest of its files (`attend_digest.json`), verified before
it is restored: a flipped bit may read without an error. An asynchronous save's
(train.py's) is written into the temporary folder before Orbax renames it, so
it is committed with the files; a synchronous save's right after the commit.

Kept: the last `keep` checkpoints, and the best one by an eval metric.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from utils.errors import CheckpointError
from utils.files import file_digests, write_whole

# in each checkpoint's folder: a flipped bit may read without an error
DIGEST_FILE = "attend_digest.json"
# files.HASHES: about five times SHA-256's speed (benchmarks/checkpoint_restore_speed.py)
DIGEST_ALGORITHM = "blake3"
# what checkpoints saved before BLAKE3 hold: `{file: sha256}`, still verified
SHA256_DIGEST_FILE = "attend_sha256.json"
# what Orbax writes into a checkpoint's folder as it commits it, after an asynchronous save's
# digest: in no digest
COMMIT_RECORDS = ("_CHECKPOINT_METADATA", "commit_success.txt")


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
                # BestN sorts ascending and keeps the last n
                reverse=not larger_is_better,
                n=1,
                keep_checkpoints_without_metrics=False,
            )
        )
        directory = Path(directory).absolute()
        self._directory = directory
        self._async_save = async_save
        self._saving: int | None = None
        # Orbax's last step before it renames an asynchronous save's temporary folder
        before_commit = ocp.AsyncOptions(post_finalization_callback=self._digest_before_commit)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
            best_fn=lambda metrics: metrics[best_metric],
            best_mode="max" if larger_is_better else "min",
            enable_async_checkpointing=async_save,
            async_options=before_commit if async_save else None,
            # done before the manager starts: see _remove_unfinished_saves
            cleanup_tmp_directories=False,
        )
        self._remove_unfinished_saves(directory)
        self.manager = ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))

    @staticmethod
    def _remove_unfinished_saves(directory: Path) -> None:
        """Removes the temporary folders of saves cut short (by a kill, say); the first process does it.

        Orbax would do it in a background thread, which an error right after start-up
        would exit under, printing its traceback over the one-line message.
        """
        if jax.process_index() == 0 and directory.exists():
            # Orbax's TemporaryPath objects
            for unfinished in ocp.utils.tmp_checkpoints(directory):
                shutil.rmtree(str(unfinished.get()), ignore_errors=True)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def save(self, step: int, state: Any, data_iterator: Any | None, metrics: dict | None = None) -> None:
        """Saves (asynchronously); `metrics` holding `best_metric` make it a candidate for best.

        The previous save is complete first (Orbax waits for it). Each save holds its digest:
        written before Orbax commits it (asynchronous), or right after (synchronous).

        Raises:
          CheckpointError: this save or the previous one could not be written (a full disk, a
            folder not writable), naming the folder; the checkpoints before it are intact.
        """
        items = {"state": ocp.args.StandardSave(state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        usable = metrics if metrics and self.best_metric in metrics else None
        with self._writing():
            self.manager.wait_until_finished()
            # the save whose temporary folder _digest_before_commit looks for
            self._saving = step
            self.manager.save(step, args=ocp.args.Composite(**items), metrics=usable, force=True)
        if not self._async_save and jax.process_index() == 0:
            # committed already: its digest right after it
            self._write_digest(self._directory / str(step))

    def save_again(self, step: int, state: Any, data_iterator: Any | None, metrics: dict | None) -> None:
        """Replaces the checkpoint at `step` with one of the same state that keeps `metrics` (a stop cut
        its evaluation short, and it was saved without them); nothing to do without `best_metric`.
        Waits for the new one: until it is committed, the run has no checkpoint at `step` (a kill
        then resumes from the one before)."""
        if not metrics or self.best_metric not in metrics:
            return
        with self._writing():
            self.manager.wait_until_finished()
            self.manager.delete(step)
        self.save(step, state, data_iterator, metrics)
        with self._writing():
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _writing(self):
        """Turns a failed write (Orbax's own thread's error included) into a `CheckpointError`."""
        try:
            yield
        except OSError as error:
            raise CheckpointError(
                f"cannot write a checkpoint to {self.manager.directory} ({error.strerror or error}); "
                "the checkpoints before it are intact: free space or fix the folder's permissions, then run the "
                "same command again to resume from the last of them"
            ) from error

    def _digest_before_commit(self) -> None:
        """Writes the digest of the asynchronous save under way into its temporary folder, which
        Orbax renames next (on the first process, once every process has written its files): the
        digest is committed with the checkpoint, so no kill leaves a committed checkpoint without
        one. It never raises: an error here, in Orbax's thread, would cost the save itself (and keep
        the other processes waiting at Orbax's barrier)."""
        try:
            for temporary in ocp.utils.tmp_checkpoints(self._directory):
                if temporary.get_final().name == str(self._saving):
                    self._write_digest(Path(temporary.get()))
        except Exception as error:
            logging.warning(
                "cannot write the digest of the checkpoint at step %s (%s): it stays unverified", self._saving, error
            )

    @staticmethod
    def _write_digest(folder: Path) -> None:
        """A digest that cannot be read or written is a warning: its checkpoint is whole, only unverified."""
        try:
            files = file_digests(folder, skip=(DIGEST_FILE, *COMMIT_RECORDS), algorithm=DIGEST_ALGORITHM)
            digests = json.dumps({"algorithm": DIGEST_ALGORITHM, "files": files}, indent=0, sort_keys=True)
            write_whole(folder / DIGEST_FILE, lambda temporary: temporary.write_text(digests))
        except OSError as error:
            logging.warning("cannot write the digest of the checkpoint in %s (%s): it stays unverified", folder, error)

    def _damage(self, step: int) -> str | None:
        """What is wrong with the files of the checkpoint at `step` by its digest, or None (also
        when it has none: a checkpoint of an older attend, one whose digest could not be written,
        or a run killed between a synchronous save's commit and its digest)."""
        folder = Path(self.manager.directory) / str(step)
        path = folder / DIGEST_FILE if (folder / DIGEST_FILE).exists() else folder / SHA256_DIGEST_FILE
        if not path.exists():
            logging.warning(
                "the checkpoint at step %d in %s has no digest to verify it by", step, self.manager.directory
            )
            return None
        try:
            recorded = json.loads(path.read_text())
            algorithm, recorded = (
                (recorded["algorithm"], recorded["files"]) if path.name == DIGEST_FILE else ("sha256", recorded)
            )
        except (OSError, ValueError, KeyError, TypeError):
            return f"its digest {path} is unreadable"
        found = file_digests(folder, skip=(path.name,), algorithm=algorithm)
        for name, digest in sorted(recorded.items()):
            if found.get(name) != digest:
                return f"{folder / name} is {'missing' if name not in found else 'changed'} since it was saved"
        return None

    def restore(
        self, abstract_state: Any, data_iterator: Any | None = None, *, step: int | None = None, verify: bool = True
    ) -> tuple[int, Any]:
        """Restores `step`, or the newest readable checkpoint (warning about any that is not), its
        files checked against their digest unless `verify` is False (benchmarks/checkpoint_restore_speed.py times both).

        `data_iterator`, when given, is set to the saved position: a run resumes. Then the unreadable
        checkpoints newer than the one restored are moved aside (`<step>.unreadable`, kept for a
        look), so that the resumed run can save those steps again and keeps its good checkpoints.

        Raises:
          CheckpointError: no checkpoint (or not the asked step), or it (every one) is unreadable.
        """

        def arguments():
            items = {"state": ocp.args.StandardRestore(abstract_state)}
            if data_iterator is not None:
                items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
            return ocp.args.Composite(**items)

        return self._restore_readable(step, arguments, set_aside=data_iterator is not None, verify=verify)

    def restore_params(self, abstract_params: Any, *, step: int | None = None) -> tuple[int, Any]:
        """Restores only the parameters of `step` (or the newest readable checkpoint): no optimizer
        state is read. Raises as `restore`, and names the parameters the checkpoint holds that the
        model has not (`partial_restore`, which leaves the optimizer state unread, would pass over
        them too: a model built with other settings than the run's, say without the attention
        biases it trained with, would be scored without a word)."""
        abstract = {"params": abstract_params}

        def arguments():
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
            return ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True)
            )

        restored_step, state = self._restore_readable(step, arguments)
        saved = saved_parameter_paths(Path(self.manager.directory) / str(restored_step) / "state")
        unread = sorted(saved - key_paths(state["params"]))
        if unread:
            raise CheckpointError(
                f"the checkpoint at step {restored_step} in {self.manager.directory} holds {len(unread)} "
                f"parameter(s) this model has not, e.g. {', '.join(unread[:3])}: the model is built with "
                "other settings than the run's (its config.json)"
            )
        return restored_step, state["params"]

    def _verified_restore(self, step: int, arguments: Callable[[], Any], verify: bool) -> Any:
        """The checkpoint at `step`, its files checked against their digest while Orbax reads them (in
        a thread: hashing overlaps the restore instead of reading every file once more before it).
        What was restored is dropped when the digest finds damage; a read that fails is reported by
        the digest's finding where it has one (the file, not TensorStore's words about an array)."""
        if not verify:
            return self.manager.restore(step, args=arguments())
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="attend-digest") as hashing:
            damage = hashing.submit(self._damage, step)
            try:
                restored = self.manager.restore(step, args=arguments())
            except Exception as error:
                if found := damage.result():
                    raise CheckpointError(found) from error
                raise
            if found := damage.result():
                raise CheckpointError(found)
        return restored

    def _restore_readable(
        self, step: int | None, arguments: Callable[[], Any], set_aside: bool = False, verify: bool = True
    ) -> tuple[int, Any]:
        available = self.steps()
        if step is not None and step not in available:
            raise CheckpointError(f"no checkpoint at step {step} in {self.manager.directory}; have {available}")
        candidates = [step] if step is not None else available[::-1]
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.manager.directory}")
        for candidate in candidates:
            try:
                restored = self._verified_restore(candidate, arguments, verify)
            except Exception as error:
                # Orbax/TensorStore raise many types for damaged files
                logging.warning(
                    "checkpoint at step %d in %s is unreadable (%s: %s)",
                    candidate,
                    self.manager.directory,
                    type(error).__name__,
                    str(error).splitlines()[0][:300],
                )
                if step is not None:
                    raise CheckpointError(
                        f"checkpoint at step {step} in {self.manager.directory} is unreadable: {error}"
                    ) from error
                continue
            if candidate != candidates[0]:
                logging.warning("fell back to the checkpoint at step %d", candidate)
                if set_aside:
                    self._set_aside([s for s in candidates if s > candidate])
            return candidate, restored["state"]
        raise CheckpointError(f"no readable checkpoint in {self.manager.directory} (tried steps {candidates})")

    def _set_aside(self, steps: list[int]) -> None:
        directory = Path(self.manager.directory)
        if jax.process_index() == 0:
            for step in steps:
                target = directory / f"{step}.unreadable"
                if target.exists():
                    # an older copy of the same step, also unreadable
                    shutil.rmtree(target)
                (directory / str(step)).rename(target)
                logging.warning("moved the unreadable checkpoint at step %d to %s", step, target)
        self.manager.reload()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's threads.

        Raises:
          CheckpointError: the last save could not be written, naming the folder.
        """
        try:
            with self._writing():
                self.manager.wait_until_finished()
        finally:
            # a failed save raises again here: Orbax's threads are released all the same
            self.manager.close()


def saved_parameter_paths(state_folder: Path) -> set[str]:
    """The parameters a checkpoint's state holds, as `key_paths` names them: from the tree Orbax records
    in the folder's `_METADATA` (a millisecond), or through Orbax's metadata API (0.05-0.15 s a call
    here) where that file is not as this Orbax writes it."""
    try:
        recorded = json.loads((state_folder / "_METADATA").read_text())["tree_metadata"]
        paths = [ast.literal_eval(key) for key in recorded]
        return {"/".join(map(str, path[1:])) for path in paths if path[0] == "params"}
    except (OSError, KeyError, TypeError, ValueError, SyntaxError, IndexError):
        return key_paths(ocp.PyTreeCheckpointer().metadata(state_folder).item_metadata["params"])


def key_paths(tree: Any) -> set[str]:
    """`{"decoder_layers/0/cross_attention/out/bias/value", ...}`: a tree's leaves by path, alike for
    a restored `nnx.State` (whose `value` is an attribute) and Orbax's metadata (a dict key)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in leaves}
