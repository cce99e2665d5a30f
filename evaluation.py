"""Evaluating a run: a split's loss, decoding, text metrics and alignment; pictures; eval and predict modes.

`Evaluator(run)` compiles the functions once (the loss sums of a batch, the
configured search, the attention weights of a teacher-forced pass); a
split is then evaluated in one pass over its batches:

- `loss`, `perplexity`, `token_accuracy` over every target token;
- the task metric of the decoded text (`exact_match`, `bleu`, ...) over every
  example, or the first `max_decoded`;
- `alignment_accuracy` where the task knows its alignments, per attention
  module over the source and their mean;
- `localization_accuracy` where a captioning task knows its words' boxes (and
  the captions are read word by word, `tokenizer.kind="word"`): see
  `metrics.localization_counts`.

`evaluate(config, workdir)` (`--mode=eval`) and `predict(config, workdir)`
(`--mode=predict`) restore a checkpoint's parameters, or the mean of the last
few, and write `eval/step_<N>.json` (and `predictions/step_<N>.tsv`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

import decoding
import input_pipeline
import metrics
import visualize
from models.attention import AttentionRole, attention_roles, capture_attention
import reporting
from errors import ConfigError
from reporting import Reporter
from run_setup import Run, gathered, output_length, prepare_run
from vocabularies import EOS_ID, PAD_ID


class Evaluator:
    """A run's compiled evaluation functions, each `(params, batch or inputs)`, built once."""

    def __init__(self, run: Run):
        self.run = run
        config = run.config
        params_sharding, batch_sharding = run.replicated, run.batch_sharding
        self.output_length = output_length(config)

        def loss_sums(params, batch) -> dict:
            return metrics.token_sums(run.model(params)(batch, deterministic=True), batch["targets"])

        def decode(params, inputs, key) -> tuple[jax.Array, jax.Array]:
            return decoding.decode(run.model(params), inputs, length=self.output_length, key=key, **decoding.options(config.decode))

        def attention(params, batch) -> dict:
            return capture_attention(run.model(params), batch)

        self.loss_sums = jax.jit(loss_sums, in_shardings=(params_sharding, batch_sharding))
        self.decode = jax.jit(decode, in_shardings=(params_sharding, batch_sharding, None))
        self.sampling_key = jax.random.key(config.seed + 3)  # sampling: one key per batch, folded from here
        self.attention = jax.jit(attention, in_shardings=(params_sharding, batch_sharding))
        model = nnx.merge(run.graphdef, run.params, run.rngs)
        self.roles = attention_roles(model)
        # captioning from pixels: where each annotation lies, for localisation and pictures
        self.reads_pixels = getattr(getattr(model, "config", None), "inputs", None) == "pixels"
        self.cell_centres, self.grid_shape = getattr(model, "cell_centres", None), getattr(model, "grid_shape", None)

    def batches(self, split: str) -> Iterator[tuple[dict, np.ndarray, dict]]:
        """`(global batch of inputs and targets, record index of every row (-1: padding), local batch)`."""
        run = self.run
        dataset, _ = input_pipeline.eval_batches(
            run.task, run.tokens, split, run.pipeline(), process_index=jax.process_index(), process_count=jax.process_count()
        )
        for local in dataset:
            batch = run.global_batch({"inputs": local["inputs"], "targets": local["targets"]})
            yield batch, gathered(run.global_batch({"index": local["index"]})["index"]), local

    def hypotheses(
        self, params: nnx.State, batch: dict, index: np.ndarray, number: int = 0
    ) -> tuple[jax.Array, list[tuple[int, list[tuple[str, float]]]]]:
        """Batch `number` decoded: the global `[B, L]` ids of the best hypotheses, and for each real
        row `(record index, [(text, score)] best first)` (one entry unless `decode.num_hypotheses`)."""
        tokens, scores = self.decode(params, batch["inputs"], jax.random.fold_in(self.sampling_key, number))
        decode_text = self.run.tokens.target.decode
        texts = [
            (int(i), [(decode_text(t), float(s)) for t, s in zip(row_tokens, row_scores) if s > decoding.NEVER / 2])
            for i, row_tokens, row_scores in zip(index, gathered(tokens), gathered(scores))  # [B, N, L], [B, N]
            if i >= 0
        ]  # fmt: skip
        return tokens[:, 0], texts

    def localization(self, params: nnx.State, batch: dict, decoded: jax.Array, boxes: np.ndarray, index: np.ndarray) -> tuple[int, int]:
        """`(localised words, words scored)` of the generated captions `decoded [B, T]` of a batch
        (their own attention, from a teacher-forced pass) against the true boxes `[B, K, 4]`."""
        weights = self.attention(params, {"inputs": batch["inputs"], "targets": decoded})
        (cross,) = [gathered(v).mean(axis=1) for k, v in weights.items() if self.roles[k] is AttentionRole.CROSS]  # [B, T, L]
        captions = gathered(decoded)
        height, width = batch["inputs"].shape[1:3]
        centres = self.cell_centres(height, width)
        hits = total = 0
        for row in np.flatnonzero(index >= 0):
            words = int(np.argmax(captions[row] == EOS_ID)) if (captions[row] == EOS_ID).any() else captions.shape[1]
            row_hits, row_total = metrics.localization_counts(cross[row], words, boxes[row], centres)
            hits, total = hits + row_hits, total + row_total
        return hits, total

    def alignment_scores(self, params: nnx.State, batch: dict, spans: np.ndarray, index: np.ndarray) -> dict[str, list[float]]:
        """Per cross-attention module: the alignment accuracy of each real row of a teacher-forced pass
        (heads averaged) against the task's true spans `[B, K, 4]`."""
        scores = {}
        for module, value in self.attention(params, batch).items():
            if self.roles[module] is AttentionRole.CROSS:
                mean = gathered(value).mean(axis=1)  # [B, T, S]
                scores[module] = [metrics.alignment_accuracy(mean[row], spans[row]) for row in np.flatnonzero(index >= 0)]
        return scores


def evaluate_split(
    evaluator: Evaluator, params: nnx.State, split: str, *, max_decoded: int = 0
) -> tuple[dict, list[tuple[int, str]]]:
    """The metrics of `split` (see the module docstring); the task metric over the first
    `max_decoded` examples (0 = all).

    Returns:
      `(metrics, [(record index, [(hypothesis text, score)] best first)])`.
    """
    run = evaluator.run
    totals, decoded, alignment, localized = None, [], {}, np.zeros(2, np.int64)
    localizing = run.task.boxes is not None and run.config.tokenizer.kind == "word" and evaluator.reads_pixels
    for number, (batch, index, local) in enumerate(evaluator.batches(split)):
        sums = evaluator.loss_sums(params, batch)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        if max_decoded == 0 or len(decoded) < max_decoded:
            best, texts = evaluator.hypotheses(params, batch, index, number)
            decoded += texts
            if localizing:
                boxes = gathered(run.global_batch({"boxes": local["boxes"]})["boxes"])
                localized += evaluator.localization(params, batch, best, boxes, index)
        if run.task.alignment is not None:
            spans = gathered(run.global_batch({"alignment": local["alignment"]})["alignment"])
            for module, scores in evaluator.alignment_scores(params, batch, spans, index).items():
                alignment.setdefault(module, []).extend(scores)
    decoded = sorted(decoded)[: max_decoded or None]
    results = metrics.summarize(jax.device_get(totals))
    results.update(text_metrics(run, split, best_of(decoded)))
    results["decoded_examples"] = len(decoded)
    results.update(alignment_results(alignment))
    if localizing:  # no caption with as many words as boxes: nothing scored, no accuracy
        results.update({"localization_accuracy": float(localized[0] / localized[1])} if localized[1] else {})
        results["localized_words"] = int(localized[1])
    return results, decoded


def best_of(decoded: list[tuple[int, list[tuple[str, float]]]]) -> list[tuple[int, str]]:
    """`(record index, best hypothesis)` of each decoded example."""
    return [(index, hypotheses[0][0]) for index, hypotheses in decoded]


def text_metrics(run: Run, split: str, decoded: list[tuple[int, str]]) -> dict:
    """The task metric of the hypotheses against their references."""
    hypotheses = [h for _, h in decoded]
    if run.task.metric == "caption":  # several references per image
        references = run.task.references(split, [i for i, _ in decoded])
        return metrics.caption_metrics(hypotheses, references, run.config.metrics.bleu_tokenize)
    records = run.task.splits[split]
    references = [run.task.pair(records[i])[1] for i, _ in decoded]
    return metrics.text_metrics(run.task.metric, hypotheses, references, run.config.metrics.bleu_tokenize)


def alignment_results(alignment: dict[str, list[float]]) -> dict:
    """`alignment_accuracy` (the mean over modules) and `alignment_accuracy/<module>`."""
    if not alignment:
        return {}
    results = {"alignment_accuracy": float(np.mean([np.mean(v) for v in alignment.values()]))}
    results.update({f"alignment_accuracy/{module}": float(np.mean(scores)) for module, scores in alignment.items()})
    return results


def draw_attention(evaluator: Evaluator, params: nnx.State, split: str, step: int, reporter: Reporter | None) -> None:
    """Pictures of the first `visualize_examples` examples of `split`: each output token's attention
    (of the model's own hypothesis) in `attention/step_<N>/` and TensorBoard."""
    run = evaluator.run
    count = run.config.visualize_examples
    batch, index, _ = next(evaluator.batches(split))
    decoded, _ = evaluator.hypotheses(params, batch, index)
    weights = {k: gathered(v) for k, v in evaluator.attention(params, {"inputs": batch["inputs"], "targets": decoded}).items()}
    inputs, hypotheses = gathered(batch["inputs"]), gathered(decoded)
    if not run.is_chief:
        return
    pictures = {}
    directory = run.workdir / "attention" / f"step_{step}"
    for row in range(min(count, int((index >= 0).sum()))):
        output = hypotheses[row][: int(np.argmax(hypotheses[row] == EOS_ID)) + 1]
        if run.task.inputs == "image":
            if not evaluator.reads_pixels:  # feature grids: no image to draw on
                break
            (cross,) = [v[row].mean(axis=0) for k, v in weights.items() if evaluator.roles[k] is AttentionRole.CROSS]
            grid = evaluator.grid_shape(*inputs.shape[1:3])
            pictures.update(visualize.draw_image_attention(
                directory, f"example_{row}", inputs[row], cross[: len(output)], grid, run.tokens.target.pieces(output)))
            continue
        source = inputs[row][inputs[row] != PAD_ID]
        pictures.update(visualize.draw_example(
            directory, f"example_{row}",
            visualize.example_weights(weights, evaluator.roles, row, len(source), len(output)), evaluator.roles,
            run.tokens.source.pieces(source), run.tokens.target.pieces(output),
            self_attention=run.config.visualize_self_attention,
        ))  # fmt: skip
    if reporter is not None:
        reporter.images(step, pictures)


def scores_by_length(run: Run, split: str, decoded: list[tuple[int, str]], width: int) -> dict:
    """The task metric per bucket of source length (in tokens), e.g. `{"0-9": {...}, "10-19": {...}}`."""
    records = run.task.splits[split]
    buckets: dict[int, list[int]] = {}
    for position, (index, _) in enumerate(decoded):
        source, _ = run.task.pair(records[index])
        buckets.setdefault(len(run.tokens.source.encode(source)) // width, []).append(position)
    by_length = {}
    for bucket in sorted(buckets):
        scores = text_metrics(run, split, [decoded[p] for p in buckets[bucket]])
        by_length[f"{bucket * width}-{bucket * width + width - 1}"] = {
            "examples": len(buckets[bucket]), **{k: v for k, v in scores.items() if not k.endswith("signature")}
        }
    return by_length


def evaluated_params(run: Run) -> tuple[int, dict[str, nnx.State]]:
    """The restored checkpoint's step, and the parameters to evaluate by result name: the checkpoint
    (`eval_split`), and with `average_last=K > 1` also the mean of the last K (`<split>_average_last_<K>`)."""
    config = run.config
    step, params = run.restore_params(config.restore_step if config.restore_step >= 0 else None, best=config.restore_best)
    evaluated = {config.eval_split: params}
    if config.average_last > 1:
        steps, averaged = run.averaged_params(config.average_last, step)
        evaluated[f"{config.eval_split}_average_last_{len(steps)}"] = averaged
    run.checkpoints.close()
    return step, evaluated


def evaluate(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """`--mode=eval`: restores a checkpoint and evaluates `config.eval_split` without training.

    Returns the split's results, or with `average_last` both results by name.
    """
    run = prepare_run(config, workdir, training=False)
    check_split(run, config.eval_split)
    with reporting.log_file(run.workdir, enabled=run.is_chief):
        step, evaluated = evaluated_params(run)
        evaluator = Evaluator(run)
        outcome = {}
        for name, params in evaluated.items():
            outcome[name], _ = evaluate_split(evaluator, params, config.eval_split, max_decoded=config.eval_decode_examples)
        report(run, step, outcome)
    return outcome[config.eval_split] if len(outcome) == 1 else outcome


def predict(config: ml_collections.ConfigDict, workdir: str | Path) -> Path:
    """`--mode=predict`: decodes `config.eval_split` into `predictions/step_<N>.tsv` (source, reference,
    hypothesis) and writes its metrics, with the task metric by source length, to `eval/step_<N>.json`."""
    run = prepare_run(config, workdir, training=False)
    check_split(run, config.eval_split)
    with reporting.log_file(run.workdir, enabled=run.is_chief):
        step, evaluated = evaluated_params(run)
        name = list(evaluated)[-1]  # the averaged parameters when asked for
        split = config.eval_split
        results, decoded = evaluate_split(Evaluator(run), evaluated[name], split, max_decoded=config.eval_decode_examples)
    path = run.workdir / "predictions" / f"step_{step}.tsv"
    if run.is_chief:
        records = run.task.splits[split]
        source = lambda i: f"{split}[{i}]" if run.task.inputs == "image" else run.task.pair(records[i])[0]  # noqa: E731
        reporting.write_predictions(path, [(source(i), run.task.pair(records[i])[1], hypothesis) for i, hypothesis in best_of(decoded)])
        if config.decode.num_hypotheses > 1:
            reporting.write_n_best(path.with_suffix(".nbest.tsv"), [(source(i), n_best) for i, n_best in decoded])
        if run.task.inputs == "text":
            results["by_source_length"] = scores_by_length(run, split, best_of(decoded), config.length_bucket_width)
    report(run, step, {name: results})
    return path


def check_split(run: Run, split: str) -> None:
    if split not in run.task.splits:
        raise ConfigError(f"eval_split {split!r} is not a split of task {run.task.name}; valid: {', '.join(run.task.splits)}")


def report(run: Run, step: int, outcome: dict[str, dict]) -> None:
    """Eval results of a checkpoint into `eval/step_<N>.json` and metrics.jsonl (kept, not truncated;
    the rows say `"mode": "eval"`, so that training's early stopping does not count them)."""
    if not run.is_chief:
        return
    reporter = Reporter(run.workdir, num_steps=step, start_step=step, enabled=True, truncate=False)
    for name, results in outcome.items():
        reporting.write_eval(run.workdir, step, name, results)
        reporter.write(step, name, {**results, "mode": "eval"})
    reporter.close()

