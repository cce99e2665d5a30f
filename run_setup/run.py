"""The `Run`: what training, evaluation and inference share (settings, data and vocabulary, the
mesh, the model, its checkpoints) and restoring (or averaging) its parameters.

`prepare_run(settings, workdir)` returns a `Run`. engine/training_loop.py, engine/evaluation.py and
inference.py each build on it and import nothing of each other (engine/training_loop.py
calls engine/evaluation.py to evaluate during training, one way). Inside a jitted
function the model is `run.model(params)`: the NNX graph merged with the
(traced) parameters.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import models
import tasks
from run_setup import preflight, sharding
from run_setup.checkpoints import Checkpoints
from run_setup.cluster import device_memory_bytes, is_chief, make_mesh, setup_distributed
from run_setup.settings import InitSettings, Settings
from scoring import score_registry
from tasks import token_cache, vocabularies
from utils.errors import CheckpointError
from utils.files import WorkdirLock, write_whole

# the share of a device's memory that a search's whole parameters may take (Run.search_shardings)
SEARCH_GATHER_SHARE = 0.25


# ----------------------------------------------------------------------------- data and vocabulary


def load_task_and_tokenizers(settings: Settings, workdir: Path) -> tuple[tasks.Task, vocabularies.Tokenizers]:
    """The task's data (built if needed) and the run's tokenizers (trained on its train split if needed).

    With several processes, the first builds and trains while the others wait, then they
    read what it wrote: concurrent builds into one data_dir or workdir would race.
    """

    def load() -> tuple[tasks.Task, vocabularies.Tokenizers]:
        task = tasks.load_task(settings.task.name, settings.task.data_dir, **settings.task.params)
        # before a tokenizer is trained and written
        settings.source.check_task(task, settings.model.fields)
        # a stream: read as far as the sample goes
        pairs = settings.source.tokenizer_pairs(token_cache.pairs(task, "train"))
        # built data of our own: the vocabulary is shelved beside it
        shards = getattr(task.splits["train"], "shards", None)
        shelf = Path(shards[0]).parent / "vocabularies" if shards else None
        reuse_vocabulary(settings, workdir / "tokenizer")
        return task, vocabularies.load_or_train(workdir / "tokenizer", settings.tokenizer, pairs, shelf=shelf)

    if is_chief():
        loaded = load()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("attend: data and tokenizer ready")
    return loaded if is_chief() else load()


def reuse_vocabulary(settings: Settings, directory: Path) -> None:
    """Copies the vocabulary of the run `init_from` or `tokenizer.from_run` name into `directory`,
    unless it holds one (a resumed run); `vocabularies.load_or_train` then loads and verifies it."""
    source = settings.init.vocabulary_from
    if source and not (directory / "settings.json").exists():
        write_whole(directory, lambda temporary: shutil.copytree(Path(source) / "tokenizer", temporary))
        logging.info("reusing the vocabulary of %s", source)


def initial_params_from(init: InitSettings, abstract: Any) -> nnx.State:
    """The parameters of the checkpoint of run `init.run` that `init` names (its latest, best or a
    step), restored into `abstract` (this run's shapes and shardings)."""
    other = Checkpoints(Path(init.run) / "checkpoints")
    try:
        step = other.best_step() if init.checkpoint == "best" else init.step
        if init.checkpoint == "best" and step is None:
            raise CheckpointError(f"init_from {init.run}:best: no checkpoint there has eval metrics to pick the best")
        restored_step, params = other.restore_params(abstract, step=step)
    finally:
        other.close()
    logging.info("starting from the parameters of %s at step %d", init.run, restored_step)
    return params


# ----------------------------------------------------------------------------- the model


def model_fields(settings: Settings, tokens: vocabularies.Tokenizers) -> dict:
    """The model settings' fields and the vocabulary's sizes and special ids."""
    return {
        **settings.model.fields,
        "vocab_size": tokens.target.vocab_size,
        "source_vocab_size": tokens.source.vocab_size,
        "bos_id": vocabularies.BOS_ID,
        "pad_id": vocabularies.PAD_ID,
    }


def build_model(settings: Settings, tokens: vocabularies.Tokenizers) -> nnx.Module:
    rngs = nnx.Rngs(params=settings.seed, dropout=settings.seed + 1)
    return models.create_model(settings.model.name, rngs=rngs, **model_fields(settings, tokens))


def create_placed_model(
    settings: Settings, tokens: vocabularies.Tokenizers, mesh: Mesh
) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rngs)` of the run's model, the parameters placed on `mesh` by the rules of
    `settings.cluster.sharding` and the RNG state replicated.

    Sharded parameters are created sharded (an initializer jitted with their shardings as its
    output's: no device ever holds more than its shards); replicated ones as before, built once and
    copied to every device, so a replicated run is bit for bit what it was.
    """
    # shapes and the parameters' axis names
    abstract_model = nnx.eval_shape(lambda: build_model(settings, tokens))
    graphdef, abstract_params, _ = split_model(abstract_model)
    specs = sharding.partition_specs(abstract_params, mesh, settings.cluster.sharding)
    param_shardings = sharding.named_shardings(specs, mesh)
    if sharding.is_replicated(specs):
        _, params, rngs = split_model(build_model(settings, tokens))
        return graphdef, jax.device_put(params, param_shardings), rngs
    create = jax.jit(
        lambda: split_model(build_model(settings, tokens))[1:],
        out_shardings=(param_shardings, NamedSharding(mesh, PartitionSpec())),
    )
    params, rngs = create()
    return graphdef, params, rngs


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rngs)`; the model must hold nothing else."""
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    if jax.tree.leaves(rest):
        raise TypeError(f"the model holds state that is neither parameters nor RNG: {rest}")
    return graphdef, params, rngs


def merge_model(graphdef: nnx.GraphDef, params: nnx.State, rngs: nnx.State) -> nnx.Module:
    """The model inside a traced function. The RNG state is copied so that its Variables belong to
    this trace (NNX States hold Variables, and a closed-over one cannot be reseeded here)."""
    return nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rngs))


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Run:
    """What training, evaluation and inference share: settings, data, vocabulary, devices, model, checkpoints.

    `task` is None for a run prepared without its data (inference reads only the run folder).
    """

    settings: Settings
    workdir: Path
    task: tasks.Task | None
    tokens: vocabularies.Tokenizers
    mesh: Mesh
    graphdef: nnx.GraphDef
    # the initial parameters, placed over the mesh by `settings.cluster.sharding`
    params: nnx.State
    rngs: nnx.State
    checkpoints: Checkpoints
    # bytes one device may use, the same in every process (cluster.device_memory_bytes)
    device_memory: int
    # held while training (the chief's)
    lock: WorkdirLock | None = None

    @property
    def is_chief(self) -> bool:
        return is_chief()

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def param_shardings(self) -> nnx.State:
        """Each parameter's sharding, by the rules of `settings.cluster.sharding` (run_setup/sharding.py)."""
        return jax.tree.map(lambda x: x.sharding, self.params)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec("data"))

    def model(self, params: nnx.State) -> nnx.Module:
        """The model with `params` (inside a traced function: see `merge_model`)."""
        return merge_model(self.graphdef, params, self.rngs)

    @property
    def search_shardings(self) -> nnx.State:
        """Where a search holds the parameters: whole along `data` (fsdp's shards gathered; tensor
        parallel's `model` splits kept), since a search's loop uses every weight at every step and
        one gather per batch then replaces one per weight and step (benchmarks/fsdp_decoding.py).
        The whole parameters live beside the run's own shards while a batch decodes: where they
        would take more than `SEARCH_GATHER_SHARE` of a device's memory, they stay as they lie."""
        whole = sharding.without_data_axis(self.param_shardings)
        needed = sharding.bytes_per_device(sharding.abstract_with_shardings(self.params, whole))
        return whole if needed <= SEARCH_GATHER_SHARE * self.device_memory else self.param_shardings

    def searching_model(self, params: nnx.State) -> nnx.Module:
        """The model for a search, inside a traced function: `params` placed as `search_shardings`
        says (a replicated run's are unchanged)."""
        return self.model(jax.lax.with_sharding_constraint(params, self.search_shardings))

    def abstract(self, tree: Any) -> Any:
        """Shapes, dtypes and shardings of `tree` (arrays on the run's mesh), for restoring into: a
        checkpoint saved under another sharding or on other devices is read into these."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

    def global_batch(self, local: dict) -> dict:
        """Process-local numpy rows -> global arrays sharded along `data`."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local.items()}

    def restore_params(self, step: int | None = None, *, best: bool = False) -> tuple[int, nnx.State]:
        """The parameters (no optimizer state) of checkpoint `step`, the best one, or the latest readable."""
        if best:
            step = self.checkpoints.best_step()
            if step is None:
                raise CheckpointError(
                    f"no checkpoint in {self.workdir / 'checkpoints'} has eval metrics to pick the best"
                )
        return self.checkpoints.restore_params(self.abstract(self.params), step=step)

    def averaged_params(self, last: int, up_to: int) -> tuple[list[int], nnx.State]:
        """The mean parameters of the last `last` checkpoints at or before step `up_to`."""
        steps = [s for s in self.checkpoints.steps() if s <= up_to][-last:]
        total = None
        for step in steps:
            _, params = self.checkpoints.restore_params(self.abstract(self.params), step=step)
            total = params if total is None else jax.tree.map(jnp.add, total, params)
        return steps, jax.tree.map(lambda p: p / len(steps), total)


def prepare_run(
    settings: Settings,
    workdir: str | Path,
    devices: Sequence[jax.Device] | None = None,
    *,
    with_data: bool = True,
    training: bool = True,
    lock: bool = False,
) -> Run:
    """Devices, data and vocabulary (or, `with_data=False`, the vocabulary saved in `workdir` only),
    the model with its initial parameters, and the checkpoint manager of `workdir`. With `lock`, the
    chief first takes the workdir's lock (`run.lock`; the caller releases it), after the settings are
    checked against the devices and before anything in the workdir is read or written."""
    setup_distributed(settings.cluster)
    mesh = make_mesh(devices, settings.cluster.sharding, settings.cluster.tensor_parallel)
    memory = device_memory_bytes(mesh)
    preflight.check(settings, mesh, memory, training=training)
    workdir = Path(workdir)
    held = None
    if lock and is_chief():
        workdir.mkdir(parents=True, exist_ok=True)
        held = WorkdirLock.acquire(workdir)
    try:
        if with_data:
            workdir.mkdir(parents=True, exist_ok=True)
            task, tokens = load_task_and_tokenizers(settings, workdir)
        else:
            task, tokens = None, vocabularies.load_or_train(workdir / "tokenizer", settings.tokenizer)
        graphdef, params, rngs = create_placed_model(settings, tokens, mesh)
        evaluation = settings.evaluation
        checkpoints = Checkpoints(
            workdir / "checkpoints",
            keep=settings.checkpoints.keep_checkpoints,
            best_metric=evaluation.best_metric,
            larger_is_better=score_registry.larger_is_better(evaluation.best_metric),
        )
    except BaseException:
        if held is not None:
            held.release()
        raise
    # fine-tuning; a run with checkpoints resumes
    if training and settings.init.run and not checkpoints.steps():
        params = initial_params_from(
            settings.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        )
    return Run(settings, workdir, task, tokens, mesh, graphdef, params, rngs, checkpoints, memory, held)
