"""The training loop: `train_and_evaluate(config, workdir)`, and `evaluate` / `predict` from a checkpoint.

Devices: one `Mesh` over every device of every process, batches sharded along
`data`, the train state replicated. The train step is one jitted pure function
of the train state (a pytree of parameters and optimizer state, split from the
NNX model) and a batch; the state is donated. Dropout keys derive from the seed
and the step, so the checkpointed step determines the RNG.

A rerun on the same workdir resumes from its latest readable checkpoint, with
the data iterator where it was. SIGTERM/SIGINT save a checkpoint and stop. A
non-finite loss stops the run naming the step; the last checkpoint, written
before it, stays the last good one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import decoding
import input_pipeline
import metrics
import models
import tasks
import tokenizers
import visualize
from checkpoints import Checkpoints
from reporting import Reporter

TrainState = dict  # {"step": int32 [], "params": nnx.State, "opt_state": optax state}


class NonFiniteLoss(RuntimeError):
    pass


# ----------------------------------------------------------------------------- set-up


def setup_distributed(config: ml_collections.ConfigDict) -> None:
    """Joins the other processes when the config or the environment names a coordinator."""
    if jax.distributed.is_initialized():
        return
    if config.coordinator_address:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
        )
    elif os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh (`data`) over `devices` (default: every device of every process)."""
    return Mesh(np.array(jax.devices() if devices is None else devices), ("data",))


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then rsqrt decay (Vaswani et al. eq. 3), cosine, or constant.

    rsqrt: `lr(step) = learning_rate * min(step / warmup, sqrt(warmup / step))`, which is
    the paper's `d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)` with its peak value
    `learning_rate = d_model^-0.5 * warmup^-0.5`.
    """
    peak, warmup = config.learning_rate, max(config.warmup_steps, 1)
    if config.schedule == "rsqrt":
        return lambda step: peak * jnp.minimum((step + 1) / warmup, jnp.sqrt(warmup / (step + 1)))
    warm = optax.linear_schedule(0.0, peak, warmup)
    if config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, max(config.num_train_steps - warmup, 1))
    elif config.schedule == "constant":
        decay = optax.constant_schedule(peak)
    else:
        raise ValueError(f"schedule must be 'rsqrt', 'cosine' or 'constant', got {config.schedule!r}")
    return optax.join_schedules([warm, decay], [warmup])


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Adam (or AdamW with weight decay) on the schedule, after optional global-norm clipping."""
    adam = optax.adamw(
        learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )  # fmt: skip
    if config.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)
    return adam


def model_fields(config: ml_collections.ConfigDict, tokens: tokenizers.Tokenizers) -> dict:
    fields = {k: v for k, v in config.model.to_dict().items() if k != "name"}
    fields.update(
        vocab_size=tokens.target.vocab_size,
        source_vocab_size=tokens.source.vocab_size,
        bos_id=tokenizers.BOS_ID,
        pad_id=tokenizers.PAD_ID,
    )
    return fields


def build_model(config: ml_collections.ConfigDict, tokens: tokenizers.Tokenizers) -> nnx.Module:
    rngs = nnx.Rngs(params=config.seed, dropout=config.seed + 1)
    return models.create_model(config.model.name, rngs=rngs, **model_fields(config, tokens))


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, params, rngs)`; the model must hold nothing else."""
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    if jax.tree.leaves(rest):
        raise ValueError(f"the model holds state that is neither parameters nor RNG: {rest}")
    return graphdef, params, rngs


def pipeline_settings(config: ml_collections.ConfigDict, batch_size: int | None = None) -> input_pipeline.PipelineSettings:
    return input_pipeline.PipelineSettings(
        batch_size=batch_size or config.batch_size,
        seed=config.seed,
        **{k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in config.data.to_dict().items()},
    )


def tokenizer_settings(config: ml_collections.ConfigDict) -> tokenizers.TokenizerSettings:
    return tokenizers.TokenizerSettings(**config.tokenizer.to_dict())


def load_task_and_tokenizers(config, workdir: Path) -> tuple[tasks.Task, tokenizers.Tokenizers]:
    """The task's data (built if needed) and the run's tokenizers (trained if needed).

    With several processes, the first builds and trains while the others wait, then they
    read what it wrote: concurrent builds into one data_dir or workdir would race.
    """

    def load() -> tuple[tasks.Task, tokenizers.Tokenizers]:
        params = {k: v for k, v in config.task.to_dict().items() if k != "name"}
        task = tasks.load_task(config.task.name, config.data_dir, **params)
        train = task.splits["train"]
        pairs = (task.pair(train[i]) for i in range(len(train)))
        return task, tokenizers.load_or_train(workdir / "tokenizer", tokenizer_settings(config), pairs)

    chief = jax.process_index() == 0
    if chief:
        loaded = load()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("attend: data and tokenizer ready")
    return loaded if chief else load()


# ----------------------------------------------------------------------------- steps


def merge_model(graphdef, params: nnx.State, rngs: nnx.State) -> nnx.Module:
    """The model inside a traced step. The RNG state is copied so that its Variables belong to
    this trace (NNX States hold Variables, and a closed-over one cannot be reseeded here)."""
    return nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rngs))


def make_train_step(graphdef, rngs, tx, config) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The pure train step `(state, batch) -> (state, metrics)`: one optimizer update.

    The global batch is split into `grad_accum_steps` microbatches whose
    gradients of the summed token loss are added; the update uses the sum over
    all non-padding tokens, so accumulation equals one big batch.
    """
    dropout_seed = jax.random.key(config.seed + 2)
    accumulate = config.grad_accum_steps
    smoothing = config.label_smoothing

    def loss_sums(params, batch, key):
        model = merge_model(graphdef, params, rngs)
        nnx.reseed(model, dropout=key)
        logits = model(batch, deterministic=False)
        sums = metrics.token_sums(logits, batch["targets"], smoothing)
        return sums["smoothed_loss_sum"], sums

    grad_fn = jax.grad(loss_sums, has_aux=True)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        key = jax.random.fold_in(dropout_seed, state["step"])
        if accumulate == 1:
            grads, sums = grad_fn(state["params"], batch, key)
        else:
            micro = jax.tree.map(lambda x: x.reshape(accumulate, -1, *x.shape[1:]), batch)  # [K, B/K, ...]

            def add(carry, inputs):
                index, microbatch = inputs
                grads, sums = grad_fn(state["params"], microbatch, jax.random.fold_in(key, index))
                return jax.tree.map(jnp.add, carry, (grads, sums)), None

            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, state["params"], batch, key))
            (grads, sums), _ = jax.lax.scan(add, zeros, (jnp.arange(accumulate), micro))
        tokens = jnp.maximum(sums["tokens"], 1.0)
        grads = jax.tree.map(lambda g: g / tokens, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        step_metrics = {
            "loss": sums["smoothed_loss_sum"] / tokens,
            "nll": sums["nll_sum"] / tokens,
            "token_accuracy": sums["correct_sum"] / tokens,
            "tokens": sums["tokens"],
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(params),
        }
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, step_metrics

    return train_step


def make_eval_step(graphdef, rngs) -> Callable[[nnx.State, dict], dict]:
    def eval_step(params, batch):
        model = merge_model(graphdef, params, rngs)
        return metrics.token_sums(model(batch, deterministic=True), batch["targets"])

    return eval_step


def make_decode(graphdef, rngs, config: ml_collections.ConfigDict) -> Callable[[nnx.State, jax.Array], jax.Array]:
    """`(params, inputs [B, S]) -> [B, L]` ids with the configured search."""
    length = config.data.max_source_length + config.decode.max_length_offset

    def decode(params, inputs):
        return decoding.decode(
            merge_model(graphdef, params, rngs),
            inputs,
            beam_size=config.decode.beam_size,
            alpha=config.decode.length_penalty,
            max_length_offset=config.decode.max_length_offset,
            length=length,
        )

    return decode


def make_attention(graphdef, rngs) -> Callable[[nnx.State, dict], dict]:
    """`(params, batch) -> {module path: weights [B, N, T, S]}` of a teacher-forced pass."""

    def attention(params, batch):
        return visualize.attention_weights(merge_model(graphdef, params, rngs), batch)

    return attention


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Run:
    """What training, eval and predict share: data, tokenizers, devices, compiled steps, checkpoints."""

    config: ml_collections.ConfigDict
    workdir: Path
    task: tasks.Task
    tokens: tokenizers.Tokenizers
    mesh: Mesh
    initial_state: TrainState
    state_sharding: Any
    graphdef: Any
    rngs: nnx.State
    train_step: Callable
    eval_step: Callable
    decode: Callable
    attention: Callable
    checkpoints: Checkpoints

    @property
    def is_chief(self) -> bool:
        return jax.process_index() == 0

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec("data"))

    @property
    def abstract_state(self) -> TrainState:
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.initial_state, self.state_sharding
        )

    def global_batch(self, local: dict) -> dict:
        """Process-local numpy rows -> global arrays sharded along `data`."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in local.items()}

    def pipeline(self) -> input_pipeline.PipelineSettings:
        return pipeline_settings(self.config)


def prepare_run(config: ml_collections.ConfigDict, workdir: str | Path, devices: Sequence[jax.Device] | None = None) -> Run:
    setup_distributed(config)
    pipeline_settings(config)  # a bad data setting stops here, before anything is built
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(devices)
    if config.batch_size % (mesh.size * config.grad_accum_steps):
        raise ValueError(
            f"batch_size {config.batch_size} must be divisible by the {mesh.size} devices "
            f"times grad_accum_steps {config.grad_accum_steps}"
        )
    task, tokens = load_task_and_tokenizers(config, workdir)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    tx = make_optimizer(config)
    graphdef, params, rngs = split_model(build_model(config, tokens))
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
    state_sharding = jax.tree.map(lambda _: replicated, state)
    return Run(
        config=config,
        workdir=workdir,
        task=task,
        tokens=tokens,
        mesh=mesh,
        initial_state=jax.device_put(state, state_sharding),
        state_sharding=state_sharding,
        graphdef=graphdef,
        rngs=rngs,
        train_step=jax.jit(
            make_train_step(graphdef, rngs, tx, config),
            in_shardings=(state_sharding, batch_sharding),
            out_shardings=(state_sharding, replicated),
            donate_argnums=0,
        ),
        eval_step=jax.jit(make_eval_step(graphdef, rngs), in_shardings=(state_sharding["params"], batch_sharding)),
        decode=jax.jit(make_decode(graphdef, rngs, config), in_shardings=(state_sharding["params"], batch_sharding)),
        attention=jax.jit(make_attention(graphdef, rngs), in_shardings=(state_sharding["params"], batch_sharding)),
        checkpoints=Checkpoints(
            workdir / "checkpoints",
            keep=config.keep_checkpoints,
            best_metric=config.best_metric,
            larger_is_better=config.best_metric_larger_is_better,
        ),
    )


def write_config(config: ml_collections.ConfigDict, workdir: Path) -> None:
    (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=list) + "\n")


def write_eval(workdir: Path, step: int, split: str, results: dict) -> None:
    """Adds one split's results to `eval/step_<N>.json` (one file per step, keyed by split)."""
    path = workdir / "eval" / f"step_{step}.json"
    path.parent.mkdir(exist_ok=True)
    existing = json.loads(path.read_text()) if path.exists() else {"step": step}
    existing[split] = results
    path.write_text(json.dumps(existing, indent=2) + "\n")


def gathered(array) -> np.ndarray:
    """A global array in full on every process."""
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def layer_alignment_accuracy(weights: dict, spans: np.ndarray, index: np.ndarray) -> dict[str, list[float]]:
    """Per encoder-decoder attention module: the alignment accuracy of each real row (heads averaged)."""
    scores = {}
    for module, value in weights.items():
        if visualize.is_cross_attention(module):
            mean = gathered(value).mean(axis=1)  # [B, T, S]
            scores[module] = [metrics.alignment_accuracy(mean[row], spans[row]) for row in np.flatnonzero(index >= 0)]
    return scores


def draw_attention(run: Run, params: nnx.State, batch: dict, decoded: jax.Array, step: int, reporter: Reporter | None) -> None:
    """Pictures of the first `visualize_examples` rows: each output token's attention over the source.

    Args:
      decoded: the global `[B, L]` array of the batch's hypotheses (the teacher-forced targets here).
    """
    weights = run.attention(params, {"inputs": batch["inputs"], "targets": decoded})
    weights = {k: gathered(v) for k, v in weights.items()}
    inputs, hypotheses = gathered(batch["inputs"]), gathered(decoded)
    count = min(run.config.visualize_examples, len(hypotheses))
    if not run.is_chief:
        return
    pictures = {}
    for row in range(count):
        source = inputs[row][inputs[row] > 0]
        output = hypotheses[row][: int(np.argmax(hypotheses[row] == tokenizers.EOS_ID)) + 1]
        cut = visualize.example_weights(weights, row, len(source), len(output))
        pictures.update(visualize.draw_example(
            run.workdir / "attention" / f"step_{step}", f"example_{row}", cut,
            run.tokens.source.pieces(source), run.tokens.target.pieces(output),
            self_attention=run.config.visualize_self_attention,
        ))  # fmt: skip
    if reporter is not None:
        reporter.images(step, pictures)


def evaluate_split(
    run: Run, params: nnx.State, split: str, *, max_decoded: int = 0, pictures: tuple[int, Reporter | None] | None = None
) -> tuple[dict, list[tuple[int, str]]]:
    """Loss, token accuracy and perplexity of a split; the task metric on (up to `max_decoded`)
    decoded examples; alignment accuracy where the task records alignments; with `pictures=(step,
    reporter)`, attention pictures of the split's first examples.

    Returns:
      `(metrics, [(record index, hypothesis text)])`.
    """
    dataset, _ = input_pipeline.eval_batches(
        run.task, run.tokens, split, run.pipeline(), process_index=jax.process_index(), process_count=jax.process_count()
    )
    totals = None
    decoded: list[tuple[int, str]] = []
    alignment: dict[str, list[float]] = {}
    for number, local in enumerate(dataset):
        batch = run.global_batch({"inputs": local["inputs"], "targets": local["targets"]})
        sums = run.eval_step(params, batch)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        index = gathered(run.global_batch({"index": local["index"]})["index"])
        if max_decoded == 0 or len(decoded) < max_decoded or number == 0:
            hypotheses = run.decode(params, batch["inputs"])
            decoded += [(int(i), run.tokens.target.decode(row)) for i, row in zip(index, gathered(hypotheses)) if i >= 0]
            if number == 0 and pictures is not None and run.config.visualize_examples:
                draw_attention(run, params, batch, hypotheses, *pictures)
        if "alignment" in local:  # attention of the teacher-forced reference against the true spans
            spans = gathered(run.global_batch({"alignment": local["alignment"]})["alignment"])
            for module, scores in layer_alignment_accuracy(run.attention(params, batch), spans, index).items():
                alignment.setdefault(module, []).extend(scores)
    results = metrics.summarize(jax.device_get(totals))
    decoded = sorted(decoded)[: max_decoded or None]
    records = run.task.splits[split]
    references = [run.task.pair(records[i])[1] for i, _ in decoded]
    results.update(metrics.text_metrics(run.task.metric, [h for _, h in decoded], references))
    results["decoded_examples"] = len(decoded)
    if alignment:
        results["alignment_accuracy"] = float(np.mean([np.mean(v) for v in alignment.values()]))
        for module, scores in alignment.items():
            results[f"alignment_accuracy/{module}"] = float(np.mean(scores))
    return results, decoded


class StopSignals:
    """SIGTERM/SIGINT set a flag the loop checks after each step (save, then stop)."""

    def __init__(self):
        self.requested = False
        self._previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame):
        logging.warning("received %s: saving a checkpoint, then stopping", signal.Signals(signum).name)
        self.requested = True

    def restore(self):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def check_finite(window: list[tuple[int, dict]]) -> None:
    for step, values in window:
        if not np.isfinite(values["loss"]):
            raise NonFiniteLoss(
                f"loss is {values['loss']} at step {step}; stopping. The last checkpoint "
                "(written before that step) is the last good state."
            )


def summarize_window(window: list[tuple[int, dict]], learning_rate: float, seconds: float) -> dict:
    """One training log row for the steps since the last one: window means of the loss terms, last norms."""
    last = window[-1][1]
    tokens = float(sum(values["tokens"] for _, values in window))
    row = {name: float(np.mean([values[name] for _, values in window])) for name in ("loss", "nll", "token_accuracy")}
    row.update({name: float(last[name]) for name in ("grad_norm", "update_norm", "param_norm")})
    row.update(
        learning_rate=learning_rate,
        tokens_per_second=tokens / max(seconds, 1e-9),
        steps_per_second=len(window) / max(seconds, 1e-9),
    )
    return row


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Trains (or resumes) in `workdir`; returns the final eval metrics by split."""
    run = prepare_run(config, workdir)
    if run.is_chief:
        write_config(config, run.workdir)
    train_data, length_report = input_pipeline.train_dataset(
        run.task, run.tokens, run.pipeline(), process_index=jax.process_index(), process_count=jax.process_count()
    )
    data_iterator = iter(train_data)
    state, start_step = run.initial_state, 0
    if run.checkpoints.steps():
        start_step, state = run.checkpoints.restore(run.abstract_state, data_iterator)
        logging.warning("resuming from the checkpoint at step %d in %s", start_step, run.checkpoints.manager.directory)
    reporter = Reporter(run.workdir, num_steps=config.num_train_steps, start_step=start_step, enabled=run.is_chief)
    if start_step == 0:
        reporter.write(0, "data", {f"train_{k}": v for k, v in length_report.items() if k != "policy"})
    schedule = learning_rate_schedule(config)
    stop = StopSignals()
    final: dict = {}
    window: list[tuple[int, Any]] = []
    window_start = time.time()
    try:
        for step in range(start_step + 1, config.num_train_steps + 1):
            state, step_metrics = run.train_step(state, run.global_batch(next(data_iterator)))
            window.append((step, step_metrics))
            last = step == config.num_train_steps
            evaluate_now = step % config.eval_every_steps == 0 or last
            save_now = step % config.checkpoint_every_steps == 0 or last or stop.requested
            if step % config.log_every_steps == 0 or evaluate_now or save_now:
                window = jax.device_get(window)
                check_finite(window)  # before any save: a checkpoint never holds a diverged state
                row = summarize_window(window, float(schedule(step - 1)), time.time() - window_start)
                if not stop.requested or step % config.log_every_steps == 0:
                    reporter.write(step, "train", row)
                reporter.progress(step, row["loss"], row["learning_rate"], row["tokens_per_second"], row["steps_per_second"])
                window, window_start = [], time.time()
            eval_metrics = None
            if evaluate_now:
                splits = ("dev", "test") if last else ("dev",)
                for split in splits:
                    pictures = (step, reporter) if split == "dev" else None
                    results, _ = evaluate_split(run, state["params"], split, max_decoded=config.eval_decode_examples, pictures=pictures)
                    reporter.write(step, split, results)
                    if run.is_chief:
                        write_eval(run.workdir, step, split, results)
                    final[split] = results
                eval_metrics = {k: v for k, v in final["dev"].items() if isinstance(v, float)}
            if save_now or stop.requested:  # a signal may have come during this step's eval
                run.checkpoints.save(step, state, data_iterator, metrics=eval_metrics)
            if stop.requested:
                logging.warning("stopped at step %d after saving a checkpoint", step)
                break
    finally:
        stop.restore()
        run.checkpoints.wait()  # an asynchronous save may still read the data iterator's state
        data_iterator.close()  # stops the prefetch threads now, not at interpreter exit
        reporter.close()
    if run.is_chief:
        print_outputs(run.workdir)
    return final


def restore_for_eval(run: Run) -> tuple[int, TrainState]:
    """The checkpoint `--mode=eval/predict` uses: `restore_step`, the best (`restore_best`), or the latest."""
    step = run.config.restore_step if run.config.restore_step >= 0 else None
    if run.config.restore_best:
        step = run.checkpoints.best_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {run.workdir / 'checkpoints'} has eval metrics to pick the best")
    return run.checkpoints.restore(run.abstract_state, step=step)


def averaged_params(run: Run, last: int, up_to: int) -> tuple[list[int], nnx.State]:
    """The mean parameters of the last `last` checkpoints at or before step `up_to`."""
    steps = [s for s in run.checkpoints.steps() if s <= up_to][-last:]
    total = None
    for step in steps:
        _, state = run.checkpoints.restore(run.abstract_state, step=step)
        total = state["params"] if total is None else jax.tree.map(jnp.add, total, state["params"])
    return steps, jax.tree.map(lambda p: p / len(steps), total)


def evaluate(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Restores a checkpoint and evaluates `config.eval_split` without training.

    With `average_last=K`, the mean of the last K checkpoints' parameters is evaluated
    too and reported beside, under `<split>_average_last_<K>`.
    """
    run = prepare_run(config, workdir)
    step, state = restore_for_eval(run)
    splits = {config.eval_split: state["params"]}
    if config.average_last > 1:
        steps, params = averaged_params(run, config.average_last, step)
        splits[f"{config.eval_split}_average_last_{len(steps)}"] = params
    outcome = {}
    for name, params in splits.items():
        results, _ = evaluate_split(run, params, config.eval_split, max_decoded=config.eval_decode_examples)
        outcome[name] = results
        if run.is_chief:
            write_eval(run.workdir, step, name, results)
    if run.is_chief:
        reporter = Reporter(run.workdir, num_steps=step, start_step=step, enabled=True, truncate=False)
        for name, results in outcome.items():
            reporter.write(step, name, results)
        reporter.close()
    return outcome[config.eval_split] if len(outcome) == 1 else outcome


def scores_by_length(run: Run, split: str, decoded: list[tuple[int, str]], width: int) -> dict:
    """The task metric per bucket of source length (in tokens), e.g. `{"0-9": {...}, "10-19": {...}}`."""
    records = run.task.splits[split]
    buckets: dict[int, list[tuple[str, str]]] = {}
    for index, hypothesis in decoded:
        source, reference = run.task.pair(records[index])
        buckets.setdefault(len(run.tokens.source.encode(source)) // width, []).append((hypothesis, reference))
    by_length = {}
    for bucket in sorted(buckets):
        hypotheses, references = zip(*buckets[bucket])
        scores = metrics.text_metrics(run.task.metric, hypotheses, references)
        by_length[f"{bucket * width}-{bucket * width + width - 1}"] = {
            "examples": len(hypotheses), **{k: v for k, v in scores.items() if not k.endswith("signature")}
        }
    return by_length


def predict(config: ml_collections.ConfigDict, workdir: str | Path, input_file: str | None = None) -> Path:
    """Decodes `config.eval_split` (or the lines of `input_file`) into `predictions/step_<N>.tsv`.

    For a split, also writes its metrics, with the task metric by source length, to `eval/step_<N>.json`.
    """
    run = prepare_run(config, workdir)
    step, state = restore_for_eval(run)
    split = config.eval_split
    if input_file:
        lines = [line.strip() for line in Path(input_file).read_text(encoding="utf-8").splitlines()]
        sources = [line for line in lines if line]
        if not sources:
            raise ValueError(f"--input_file {input_file} holds no source line")
        split = "input"
        run.task = dataclasses.replace(run.task, splits={split: [{"source": s, "target": ""} for s in sources]}, source_key="source", target_key="target")
    results, decoded = evaluate_split(run, state["params"], split)
    path = run.workdir / "predictions" / f"step_{step}{'_' + Path(input_file).stem if input_file else ''}.tsv"
    if run.is_chief:
        path.parent.mkdir(exist_ok=True)
        records = run.task.splits[split]
        with path.open("w") as f:
            f.write("source\treference\thypothesis\n")
            for index, hypothesis in decoded:
                source, reference = run.task.pair(records[index])
                f.write("\t".join(text.replace("\t", " ") for text in (source, reference, hypothesis)) + "\n")
        if not input_file:
            results["by_source_length"] = scores_by_length(run, split, decoded, config.length_bucket_width)
            write_eval(run.workdir, step, split, results)
    return path


def print_outputs(workdir: Path) -> None:
    lines = [
        f"run folder:   {workdir}",
        f"checkpoints:  {workdir / 'checkpoints'}",
        f"metrics:      {workdir / 'metrics.jsonl'}, {workdir / 'eval'}/",
        f"tensorboard:  tensorboard --logdir {workdir / 'tensorboard'}",
    ]
    if (workdir / "attention").exists():
        lines.append(f"pictures:     {workdir / 'attention'}/ (attention heat maps and .npz weights)")
    print("\n".join(lines), flush=True)
