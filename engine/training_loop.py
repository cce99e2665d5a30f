"""The training loop: `train_and_evaluate(settings, workdir)`, the train step, the optimizer and its schedule.

The train step is one jitted pure function of the train state (a pytree of
parameters and optimizer state, split from the NNX model) and a batch; the
state is donated. Dropout keys derive from the seed and the step, so the
checkpointed step determines the RNG. The run set-up (devices, data, model,
checkpoints) is `run_setup`'s; evaluation during training is `engine/evaluation.py`'s.

A rerun on the same workdir resumes from its latest readable checkpoint, with
the data iterator where it was. SIGTERM/SIGINT save a checkpoint and stop; with
several processes a SIGTERM to any of them is JAX's preemption notice, and every
process saves after the same step and stops. A
non-finite loss stops the run naming the step; the last checkpoint, written
before it, stays the last good one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import input_pipeline
from engine import evaluation, exported_step
from report import pages
from run_setup import sharding, summary
from run_setup.compatibility import check_init, check_resume
from run_setup.run import Run, prepare_run
from run_setup.settings import EvaluationSettings, OptimizationSettings, Settings, write_run_config
from scoring import metrics, score_registry
from utils import allocator, files, metric_writer, stop_signals
from utils.errors import ConfigError, NonFiniteLoss
from utils.metric_writer import Reporter

# {"step": int32 [], "params": nnx.State, "opt_state": optax state[, "model_state": dict]}
TrainState = dict


# ----------------------------------------------------------------------------- set-up


def learning_rate_schedule(optimization: OptimizationSettings) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then rsqrt decay (Vaswani et al. eq. 3), cosine, or constant.

    rsqrt: `lr(step) = learning_rate * min(step / warmup, sqrt(warmup / step))`, which is
    the paper's `d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)` with its peak value
    `learning_rate = d_model^-0.5 * warmup^-0.5`.
    """
    peak, warmup = optimization.learning_rate, max(optimization.warmup_steps, 1)
    if optimization.schedule == "rsqrt":
        return lambda step: peak * jnp.minimum((step + 1) / warmup, jnp.sqrt(warmup / (step + 1)))
    warm = optax.linear_schedule(0.0, peak, warmup)
    if optimization.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, max(optimization.num_train_steps - warmup, 1))
    elif optimization.schedule == "constant":
        decay = optax.constant_schedule(peak)
    else:
        raise ConfigError(f"schedule must be 'rsqrt', 'cosine' or 'constant', got {optimization.schedule!r}")
    return optax.join_schedules([warm, decay], [warmup])


def make_optimizer(optimization: OptimizationSettings) -> optax.GradientTransformation:
    """Adam (or AdamW with weight decay) on the schedule, after optional global-norm clipping."""
    adam = optax.adamw(
        learning_rate_schedule(optimization),
        b1=optimization.adam_b1,
        b2=optimization.adam_b2,
        eps=optimization.adam_eps,
        weight_decay=optimization.weight_decay,
    )
    if optimization.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(optimization.grad_clip_norm), adam)
    return adam


# ----------------------------------------------------------------------------- steps


def make_train_step(
    run: Run, tx: optax.GradientTransformation
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The pure train step `(state, batch) -> (state, metrics)`: one optimizer update.

    The global batch is split into `grad_accum_steps` microbatches whose
    gradients of the summed token loss are added; the update uses the sum over
    all non-padding tokens, so accumulation equals one big batch. The loop over
    them holds `grad_accum_unroll` microbatches an iteration (`lax.scan`'s
    `unroll`), independent, so that XLA may run them side by side.

    Of the settings, the step reads the seed, the model, the optimization and (through the mesh) the
    cluster's: `engine.exported_step.export_key` keys a kept step on those; a setting read here
    besides them belongs in that key.
    """
    dropout_seed = jax.random.key(run.settings.seed + 2)
    accumulate = run.settings.optimization.grad_accum_steps
    unroll = run.settings.optimization.grad_accum_unroll
    smoothing = run.settings.optimization.label_smoothing

    def loss_sums(params, model_state, batch, key):
        """The summed loss to minimise, with `(token sums, next model state)`: the smoothed token
        loss, or the model's own `objective` where it has one (the captioner's regularisers and
        hard attention's estimator, whose moving-average baseline is its model state)."""
        model = run.model(params)
        nnx.reseed(model, dropout=key)
        if model.config.has_objective:
            token_sums = functools.partial(metrics.token_sums, label_smoothing=smoothing)
            loss, sums, model_state = model.objective(batch, model_state, jax.random.fold_in(key, 1), token_sums)
            return loss, (sums, model_state)
        sums = metrics.token_sums(model(batch, deterministic=False), batch["targets"], smoothing)
        return sums["smoothed_loss_sum"], (sums, model_state)

    # jitted: the accumulation below traces it for its gradients' shapes and then in the scan with the
    # same shapes, and a jitted function's trace is reused (the model is traced once, not twice)
    grad_fn = jax.jit(jax.grad(loss_sums, has_aux=True))

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        key = jax.random.fold_in(dropout_seed, state["step"])
        model_state = state.get("model_state", {})
        if accumulate == 1:
            grads, (sums, model_state) = grad_fn(state["params"], model_state, batch, key)
        else:
            micro = input_pipeline.microbatches(batch, accumulate)  # [K, B/K, ...]

            # every microbatch starts from the step's model state
            def add(total, inputs):
                index, microbatch = inputs
                grads, (sums, new_state) = grad_fn(
                    state["params"], model_state, microbatch, jax.random.fold_in(key, index)
                )
                return jax.tree.map(jnp.add, total, (grads, sums)), new_state

            grad_shapes, (sum_shapes, _) = jax.eval_shape(
                grad_fn, state["params"], model_state, jax.tree.map(lambda x: x[0], micro), key
            )
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (grad_shapes, sum_shapes))
            (grads, sums), new_states = jax.lax.scan(add, zeros, (jnp.arange(accumulate), micro), unroll=unroll)
            # the mean of the microbatches' next states: for a moving average such as hard attention's
            # baseline, the update with the whole batch's mean, as one big batch would make
            model_state = jax.tree.map(lambda s: s.mean(axis=0), new_states)
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
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if "model_state" in state:
            new_state["model_state"] = model_state
        return new_state, step_metrics

    return train_step


class StepQueue:
    """At most two train steps in flight. JAX returns from a step as soon as it is queued, so a loop that
    reads nothing until its next log row runs ahead by up to a log window of steps, and a stop's save
    waits for all of them (46 steps of 2.5 s on a kjv_web LSTMN run: past the stop's limit). Here a
    stop waits for at most two steps; the device idles only where the host's work for a step (its
    batch, a collection) outlasts a step."""

    def __init__(self) -> None:
        self._previous = None

    def added(self, outputs) -> None:
        """Called once a step is queued (`outputs`: any of its results): waits for the step before it."""
        if self._previous is not None:
            jax.block_until_ready(self._previous)
        self._previous = outputs


def compile_train_step(
    run: Run, tx: optax.GradientTransformation, state: TrainState
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The train step jitted over the run's mesh: `state` (shaped like `initial_state`) donated, in and
    out with the shardings it has (JAX refuses a donation whose output shardings are left open), the
    batch sharded along `data`."""
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(
        make_train_step(run, tx),
        in_shardings=(state_sharding, run.batch_sharding),
        out_shardings=(state_sharding, run.replicated),
        donate_argnums=0,
    )


# In JAX's compilation cache folder: the train step's buffer size of each run config (the most recent
# ones), for the huge pages touched ahead of the next such run's first step (`allocator.touch_huge_pages`)
STEP_BUFFERS_MEMO = "attend_step_buffers.json"
STEP_BUFFERS_KEPT = 256


def step_buffers_memo() -> Path | None:
    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) / STEP_BUFFERS_MEMO if folder else None


def step_key(settings: Settings) -> str:
    """The run's settings and JAX's version, which decide its train step's program."""
    facts = [settings.as_dict(), jax.__version__]
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=list).encode()).hexdigest()


def remembered_step_buffer(settings: Settings) -> int:
    """The bytes of the train step's buffer when a run with these settings last compiled it; 0 if unknown."""
    memo = step_buffers_memo()
    size = files.read_memo(memo).get(step_key(settings)) if memo else None
    return size if isinstance(size, int) else 0


def remember_step_buffer(settings: Settings, compiled: jax.stages.Compiled) -> None:
    """Keeps the compiled train step's buffer size for the next run with these settings: a hint, so a
    memo that cannot be written is left as it is."""
    memo, analysis = step_buffers_memo(), compiled.memory_analysis()
    if memo is None or analysis is None:
        return
    known, key = files.read_memo(memo), step_key(settings)
    # re-inserted: the most recent last
    known.pop(key, None)
    known[key] = int(analysis.temp_size_in_bytes)
    # the most recent: a sweep's trials add one each
    known = dict(list(known.items())[-STEP_BUFFERS_KEPT:])
    try:
        files.write_whole(memo, lambda temporary: temporary.write_text(json.dumps(known)))
    except OSError as error:
        logging.debug("the train step's buffer size is not kept: %s", error)


def initial_state(run: Run, tx: optax.GradientTransformation) -> TrainState:
    """Step 0: a copy of the run's initial parameters (the step donates its state) and a fresh
    optimizer state, sharded as the parameters are (Adam's moments as their parameters, the rest
    replicated)."""
    params = jax.device_put(jax.tree.map(jnp.copy, run.params), run.param_shardings)
    opt_state = jax.jit(
        tx.init, out_shardings=sharding.optimizer_shardings(tx, params, run.param_shardings, run.replicated)
    )(params)
    state = {"step": jax.device_put(jnp.zeros((), jnp.int32), run.replicated), "params": params, "opt_state": opt_state}
    model = run.model(run.params)
    # e.g. hard attention's baseline
    model_state = model.initial_model_state() if model.config.has_objective else {}
    if model_state:
        state["model_state"] = jax.device_put(model_state, run.replicated)
    return state


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


UNFINISHED_WINDOW = "unfinished_window.json"


def keep_unfinished_window(workdir: Path, step: int, window: list[tuple[int, dict]], seconds: float) -> None:
    """Keeps the per-step metrics of a window cut short by a stop at `step` (a checkpoint step), and
    the seconds its steps took, so that the resumed run logs the rows an uninterrupted run would (its
    speeds counting the steps trained before the stop at the time they took)."""
    steps = [[s, {name: float(value) for name, value in values.items()}] for s, values in window]
    (workdir / UNFINISHED_WINDOW).write_text(json.dumps({"step": step, "seconds": seconds, "window": steps}))


def unfinished_window(workdir: Path, start_step: int) -> tuple[list[tuple[int, dict]], float]:
    """`(window, seconds)` kept by `keep_unfinished_window` when this run resumes from its step, else
    `([], 0.0)`."""
    path = workdir / UNFINISHED_WINDOW
    try:
        kept = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as error:
        # a damaged file costs only the mean of one log row
        logging.warning(
            "ignoring %s (%s): the next training row covers only the steps after %d", path, error, start_step
        )
        kept = {}
    if kept.get("step") != start_step:
        return [], 0.0
    # as the step gave them
    window = [(s, {name: np.float32(value) for name, value in values.items()}) for s, values in kept["window"]]
    return window, float(kept.get("seconds", 0.0))


def evaluate_during_training(
    evaluator: evaluation.Evaluator,
    params: nnx.State,
    step: int,
    splits: Sequence[str],
    reporter: Reporter,
    curves: CurvesPicture,
) -> dict[str, dict]:
    """`splits` evaluated (on `eval_decode_examples` decoded examples), with pictures of dev examples;
    report.html rewritten, and curves.png when `curves` says it is due."""
    run = evaluator.run
    settings = run.settings.evaluation
    results = {}
    for split in splits:
        results[split], decoded = evaluation.evaluate_split(
            evaluator, params, split, max_decoded=settings.eval_decode_examples
        )
        # the row and the files together: a rerun redoes a split without its eval file
        with stop_signals.uninterrupted():
            reporter.write(step, split, results[split])
            if run.is_chief:
                metric_writer.write_eval(run.workdir, step, split, results[split])
                evaluation.write_best_hypotheses(
                    run, split, decoded, run.workdir / "predictions" / f"step_{step}_{split}.tsv"
                )
        if split == "dev" and settings.visualize_examples:
            # whole or not at all: a picture folder cut short would stop every later report page
            with stop_signals.uninterrupted():
                evaluation.draw_attention(evaluator, params, "dev", step, reporter)
    if run.is_chief:
        # the run's last evaluation: nothing is written after it
        final = step == run.settings.optimization.num_train_steps and "test" in splits
        due = curves.due(final)
        # report.html as of this evaluation, and curves.png when due
        pages.write(run.workdir, curves=due)
        if due:
            curves.drawn(final)
    return results


def evaluate_at_step(
    evaluator: evaluation.Evaluator,
    params: nnx.State,
    step: int,
    splits: Sequence[str],
    *,
    reporter: Reporter,
    curves: CurvesPicture,
    early_stopping: EarlyStopping,
) -> tuple[dict[str, dict], bool]:
    """`(results by split, stop early)`: `splits` evaluated at `step`; where the dev results end the
    run early (`early_stopping`), the test split too."""
    run = evaluator.run
    results = evaluate_during_training(evaluator, params, step, splits, reporter, curves)
    last = step == run.settings.optimization.num_train_steps
    stop_early = "dev" in results and early_stopping.update(step, results["dev"]) and not last
    if stop_early:
        logging.info(
            "early stopping at step %d: dev %s has not improved for %d evaluations (best %.4g at step %d)",
            step,
            early_stopping.metric,
            early_stopping.waited,
            early_stopping.best,
            early_stopping.best_step,
        )
        results.update(evaluate_during_training(evaluator, params, step, ("test",), reporter, curves))
    return results, stop_early


def unfinished_evaluation(run: Run, step: int, stopped_early: bool) -> tuple[str, ...]:
    """The splits of the evaluation due at `step` (the checkpoint resumed from) that have no results
    in `eval/step_<step>.json`: a stop cut that evaluation short, and saved the checkpoint without it."""
    optimization = run.settings.optimization
    last = step == optimization.num_train_steps
    if step == 0 or not (step % run.settings.evaluation.eval_every_steps == 0 or last):
        return ()
    due = ("dev", "test") if last or stopped_early else ("dev",)
    return tuple(split for split in due if split not in evaluated_splits(run.workdir, step))


def evaluated_splits(workdir: Path, step: int) -> dict[str, dict]:
    """The results by split in `eval/step_<step>.json` (none when it does not exist)."""
    path = workdir / "eval" / f"step_{step}.json"
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "step"} if path.exists() else {}


def kept_metrics(results: dict[str, dict]) -> dict | None:
    """The dev results a checkpoint keeps (its best-checkpoint ranking)."""
    return {k: v for k, v in results.get("dev", {}).items() if isinstance(v, float)} or None


CURVES_EVERY_SECONDS = 300.0


class CurvesPicture:
    """When training redraws `curves.png`: at an evaluation once `CURVES_EVERY_SECONDS` have passed
    since the run started or last drew it, at the last step's, and when the run ends otherwise
    (stopped early, by a signal or by an error). report.html follows every evaluation; the picture,
    for a glance from a terminal, takes about as long to draw as a small model's evaluation
    (benchmarks/report_page_cost.py's `curves s`)."""

    def __init__(self, workdir: Path, enabled: bool):
        self.workdir, self.enabled = workdir, enabled
        self.drawn_at, self.final = time.monotonic(), False

    def due(self, final: bool = False) -> bool:
        return self.enabled and (final or time.monotonic() - self.drawn_at >= CURVES_EVERY_SECONDS)

    def drawn(self, final: bool = False) -> None:
        self.drawn_at, self.final = time.monotonic(), final

    def finish(self) -> None:
        """Draws the picture unless the run's last evaluation did (after which nothing is written)."""
        if self.enabled and not self.final:
            pages.draw_curves(self.workdir)
            self.drawn(final=True)


class EarlyStopping:
    """Counts the dev evaluations since `best_metric` last improved; `patience` of them (0: never)
    end the run. The count is rebuilt from metrics.jsonl on resume, so it survives one."""

    def __init__(self, config: EvaluationSettings, earlier_dev_rows: Sequence[dict]):
        self.patience, self.metric = config.early_stopping_patience, config.best_metric
        self.sign = 1.0 if score_registry.larger_is_better(config.best_metric) else -1.0
        self.best, self.best_step, self.waited = None, None, 0
        for row in earlier_dev_rows:
            self.update(row["step"], row)

    @property
    def stopped(self) -> bool:
        return 0 < self.patience <= self.waited

    def update(self, step: int, dev_results: dict) -> bool:
        """Records an evaluation; True when the run should stop."""
        value = dev_results.get(self.metric)
        if value is None:
            return False
        if self.best is None or self.sign * value > self.sign * self.best:
            self.best, self.best_step, self.waited = value, step, 0
        else:
            self.waited += 1
        return self.stopped


def train_and_evaluate(settings: Settings, workdir: str | Path) -> dict:
    """Trains (or resumes) in `workdir`; returns the final eval metrics by split.

    A rerun on a workdir must be the same run: `run_setup.compatibility.check_resume` refuses a changed model,
    task, tokenizer, data or seed field before anything is written; config.json records the rest.
    """
    settings = check_resume(settings, Path(workdir))
    # a run to start from that does not fit stops here, before anything is written
    check_init(settings, Path(workdir))
    # SIGTERM and SIGINT: stopped within seconds wherever they land (utils/stop_signals.py)
    with stop_signals.handled():
        # the first step's buffer, on pages touched while the run is prepared
        release_pages = allocator.touch_huge_pages(remembered_step_buffer(settings))
        try:
            # a second run on the workdir stops here, having written nothing
            run = prepare_run(settings, workdir, lock=True)
            try:
                with metric_writer.log_file(run.workdir, enabled=run.is_chief):
                    return train(run, release_pages)
            finally:
                if run.lock is not None:
                    run.lock.release()
        finally:
            release_pages()


def train(run: Run, release_pages: Callable[[], None] = lambda: None) -> dict:
    """The loop of `train_and_evaluate` on a prepared run; `release_pages` is called once the first
    step is compiled, just before it runs (`allocator.touch_huge_pages`)."""
    optimization, evaluation_settings = run.settings.optimization, run.settings.evaluation
    if run.is_chief:
        write_run_config(run.settings, run.workdir)
    tx = make_optimizer(optimization)
    state, start_step = initial_state(run, tx), 0
    logging.info(sharding.memory_line(run.mesh, run.settings.cluster.sharding, state["params"], state["opt_state"]))
    # read back, the step is not traced again (1.1-1.4 s of the kjv_web_transformer's start)
    train_step = exported_step.cached(compile_train_step(run, tx, state), run.settings, run.replicated)
    evaluator = evaluation.Evaluator(run)
    train_data, length_report = input_pipeline.train_dataset(
        run.task,
        run.tokens,
        run.settings.data,
        run.settings.source,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    data_iterator = iter(train_data)
    if run.checkpoints.steps():
        abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        start_step, state = run.checkpoints.restore(abstract_state, data_iterator)
        logging.info("resuming from the checkpoint at step %d in %s", start_step, run.checkpoints.manager.directory)
    reporter = Reporter(
        run.workdir, num_steps=optimization.num_train_steps, start_step=start_step, enabled=run.is_chief
    )
    training_dev_rows = [
        r
        for r in metric_writer.read_jsonl(run.workdir)
        if r["split"] == "dev" and "mode" not in r and r["step"] <= start_step
    ]
    early_stopping = EarlyStopping(evaluation_settings, training_dev_rows)
    # the checkpoint's step
    resumed_step = start_step
    # a rerun of a run that stopped early: nothing more to train
    if early_stopping.stopped:
        logging.info(
            "the run stopped early at step %d (dev %s not improved for %d evaluations); not training further",
            start_step,
            evaluation_settings.best_metric,
            early_stopping.waited,
        )
        start_step = optimization.num_train_steps
    summary.log_start(run, start_step)
    if start_step == 0:
        reporter.write(0, "data", {f"train_{k}": v for k, v in length_report.items() if k != "policy"})
    schedule = learning_rate_schedule(optimization)
    final: dict = {}
    # seconds_before: the window's steps before a stop
    window, seconds_before = unfinished_window(run.workdir, start_step)
    window_start = time.time()
    curves = CurvesPicture(run.workdir, enabled=run.is_chief and run.settings.evaluation.curves_png)
    evaluate_at = functools.partial(
        evaluate_at_step, evaluator, reporter=reporter, curves=curves, early_stopping=early_stopping
    )
    stopped_at, cut_evaluation = None, False
    try:
        # a stop during the evaluation of the step resumed from: done first, before any training
        unfinished = unfinished_evaluation(run, resumed_step, early_stopping.stopped)
        if unfinished:
            try:
                with stop_signals.abortable(f"evaluating {', '.join(unfinished)} at step {resumed_step}"):
                    final, stop_early = evaluate_at(state["params"], resumed_step, unfinished)
            except stop_signals.Stopped as stopped:
                stopped.kept = f"the checkpoint at step {resumed_step} (its evaluation is redone first)"
                raise
            # its checkpoint was saved without the evaluation's metrics (its best-checkpoint ranking)
            with stop_signals.deferred():
                final = {**evaluated_splits(run.workdir, resumed_step), **final}
                run.checkpoints.save_again(resumed_step, state, data_iterator, metrics=kept_metrics(final))
            if stop_early:
                start_step = optimization.num_train_steps
        several = jax.process_count() > 1
        queue = StepQueue()
        # a signal during a step or a save: the loop saves after the step, then stops
        with stop_signals.deferred(), stop_signals.phase("training"):
            for step in range(start_step + 1, optimization.num_train_steps + 1):
                # the first step compiles it: stopped there, nothing is lost
                first = step == start_step + 1
                # the step's name for the messages (and the test hook)
                with (
                    stop_signals.abortable("compiling the train step")
                    if first
                    else stop_signals.phase(f"training step {step}")
                ):
                    batch = run.global_batch(next(data_iterator))
                    if first:
                        # compiled here (the call reuses it) for its buffer's size, kept for the next run
                        compiled = train_step.lower(state, batch).compile()
                        release_pages()
                    state, step_metrics = train_step(state, batch)
                    if first:
                        # while the step runs: the analysis takes 0.2 s of the start-up otherwise
                        remember_step_buffer(run.settings, compiled)
                    # inside the step's phase: a signal while it waits saves after this step
                    queue.added(step_metrics)
                    if first:
                        # a stop whose `Stopped` JAX's tracing swallowed (a bare `except:`) is one
                        # while compiling all the same: this step is not kept
                        stop_signals.check()
                # with several processes, SIGTERM is JAX's preemption notice, which the processes agree on
                if several and multihost_utils.reached_preemption_sync_point(step):
                    logging.warning(
                        "a process was sent SIGTERM: every process saves a checkpoint after step %d, then stops", step
                    )
                    stop_signals.request()
                window.append((step, step_metrics))
                last = step == optimization.num_train_steps
                evaluate_now = step % evaluation_settings.eval_every_steps == 0 or last
                save_now = (
                    step % run.settings.checkpoints.checkpoint_every_steps == 0 or last or stop_signals.requested()
                )
                if step % optimization.log_every_steps == 0 or evaluate_now or save_now:
                    window = jax.device_get(window)
                    # before any save: a checkpoint never holds a diverged state
                    check_finite(window)
                    seconds = seconds_before + time.time() - window_start
                    row = summarize_window(window, float(schedule(step - 1)), seconds)
                    if not stop_signals.requested() or step % optimization.log_every_steps == 0:
                        reporter.write(step, "train", row)
                    elif run.is_chief:
                        # stopped between two rows: the rerun's next row takes these steps in
                        keep_unfinished_window(run.workdir, step, window, seconds)
                    reporter.progress(
                        step, row["loss"], row["learning_rate"], row["tokens_per_second"], row["steps_per_second"]
                    )
                    window, window_start, seconds_before = [], time.time(), 0.0
                eval_metrics, stop_early = None, False
                if evaluate_now:
                    try:
                        with stop_signals.abortable(f"evaluating at step {step}"):
                            splits = ("dev", "test") if last else ("dev",)
                            final, stop_early = evaluate_at(state["params"], step, splits)
                        eval_metrics = kept_metrics(final)
                    except stop_signals.Stopped:
                        # saved below with what its files hold (the rerun evaluates the rest first)
                        eval_metrics = kept_metrics(evaluated_splits(run.workdir, step))
                        cut_evaluation = bool(unfinished_evaluation(run, step, early_stopping.stopped))
                # a signal may have come during this step's eval
                if save_now or stop_signals.requested() or stop_early:
                    with stop_signals.phase(f"saving the checkpoint at step {step}"):
                        run.checkpoints.save(step, state, data_iterator, metrics=eval_metrics)
                if stop_signals.requested():
                    stopped_at = step
                    break
                if stop_early:
                    logging.info("stopped at step %d after saving a checkpoint", step)
                    break
    except stop_signals.Stopped as stopped:
        # compiling the first step: nothing trained since the checkpoint resumed from
        stopped.kept = stopped.kept or (f"the checkpoint at step {resumed_step}" if resumed_step else "the data built")
        raise
    finally:
        try:
            # waits for pending saves, which may still read the data iterator's state
            run.checkpoints.close()
        finally:
            # also after a failed save: stops the prefetch threads now, not at interpreter exit
            data_iterator.close()
            reporter.close()
            # also after an error (a diverged loss): the picture of every row written
            curves.finish()
    # a signal after the last step's evaluation, or after an early stop's: the run is complete
    if stopped_at is not None and (cut_evaluation or (stopped_at < optimization.num_train_steps and not stop_early)):
        redone = " (its evaluation is redone first)" if cut_evaluation else ""
        raise stop_signals.Stopped(
            stop_signals.signum(), stop_signals.where(), f"the checkpoint at step {stopped_at}{redone}"
        )
    if run.is_chief:
        print_outputs(run.workdir)
    return final


def print_outputs(workdir: Path) -> None:
    curves = workdir / "curves.png"
    lines = [
        f"run folder:   {workdir}",
        f"checkpoints:  {workdir / 'checkpoints'}",
        f"metrics:      {workdir / 'metrics.jsonl'}, {workdir / 'eval'}/",
        f"tensorboard:  tensorboard --logdir {workdir / 'tensorboard'}",
        f"report:       {workdir / 'report.html'} (open it in a browser){f', {curves}' if curves.exists() else ''}",
    ]
    if (workdir / "attention").exists():
        lines.append(f"pictures:     {workdir / 'attention'}/ (attention heat maps and .npz weights)")
    print("\n".join(lines), flush=True)
