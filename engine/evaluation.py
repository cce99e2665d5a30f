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

`evaluate(settings, workdir)` (`--mode=eval`) and `predict(settings, workdir)`
(`--mode=predict`) restore a checkpoint's parameters, or the mean of the last
few, and write `eval/step_<N>.json` (and `predictions/step_<N>.tsv`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import input_pipeline
from models.attention import AttentionRole, attention_roles, capture_attention
from report import pages, pictures
from run_setup.cluster import gathered
from run_setup.run import Run, prepare_run
from run_setup.settings import Settings
from scoring import decoding, metrics, score_registry
from tasks.vocabularies import EOS_ID
from utils import metric_writer, progress
from utils.errors import ConfigError
from utils.metric_writer import Reporter


class Evaluator:
    """A run's compiled evaluation functions, each `(params, batch or inputs)`, built once."""

    def __init__(self, run: Run):
        self.run = run
        settings = run.settings
        params_sharding, batch_sharding = run.param_shardings, run.batch_sharding
        self.output_length = settings.output_length()
        search_options = settings.decode.search_options()

        # in the train step's microbatches where the rows divide into them: the logits of 64 rows of
        # 128 tokens over an 8000-word vocabulary at once took more memory than the train step
        # (kjv_web_transformer's XLA buffer: 0.73 GiB at once, 0.19 GiB in four; its train step's 0.67)
        rows = settings.data.eval_rows()
        accumulate = settings.optimization.grad_accum_steps
        chunks = accumulate if rows % accumulate == 0 else 1

        def loss_sums(params, batch) -> dict:
            def sums_of(part: dict) -> dict:
                return metrics.token_sums(run.model(params)(part, deterministic=True), part["targets"])

            if chunks == 1:
                return sums_of(batch)
            # one after the other
            sums = jax.lax.map(sums_of, input_pipeline.microbatches(batch, chunks))
            return jax.tree.map(lambda total: total.sum(axis=0), sums)

        def decode(params, inputs, key) -> tuple[jax.Array, jax.Array]:
            return decoding.decode(
                run.searching_model(params), inputs, length=self.output_length, key=key, **search_options
            )

        def attention(params, batch) -> dict:
            return capture_attention(run.model(params), batch)

        self.loss_sums = jax.jit(loss_sums, in_shardings=(params_sharding, batch_sharding))
        self.decode = jax.jit(decode, in_shardings=(params_sharding, batch_sharding, None))
        # sampling: one key per batch, folded from here
        self.sampling_key = jax.random.key(settings.seed + 3)
        self.attention = jax.jit(attention, in_shardings=(params_sharding, batch_sharding))
        # outside jit: roles, grid geometry
        self.concrete_model = nnx.merge(run.graphdef, run.params, run.rngs)
        self.roles = attention_roles(self.concrete_model)
        self.kind = settings.source

    def batches(self, split: str) -> Iterator[tuple[dict, np.ndarray, dict]]:
        """`(global batch of inputs and targets, record index of every row (-1: padding), local batch)`."""
        run = self.run
        dataset, _ = input_pipeline.eval_batches(
            run.task,
            run.tokens,
            split,
            run.settings.data,
            run.settings.source,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        for local in dataset:
            batch = run.global_batch({"inputs": local["inputs"], "targets": local["targets"]})
            yield batch, gathered(run.global_batch({"index": local["index"]})["index"]), local

    def hypotheses(
        self, params: nnx.State, batch: dict, index: np.ndarray, number: int = 0
    ) -> tuple[jax.Array, list[tuple[int, list[tuple[str, float]]]]]:
        """Batch `number` decoded: the global `[B, L]` ids of the best hypotheses, and for each real
        row `(record index, [(text, score)] best first)` (one entry unless `decode.num_hypotheses`)."""
        tokens, hypothesis_scores = self.decode(params, batch["inputs"], jax.random.fold_in(self.sampling_key, number))
        decode_text = self.run.tokens.target.decode
        texts = [
            (int(i), [(decode_text(t), float(s)) for t, s in zip(row_tokens, row_scores) if s > decoding.NEVER / 2])
            # [B, N, L], [B, N]
            for i, row_tokens, row_scores in zip(index, gathered(tokens), gathered(hypothesis_scores))
            if i >= 0
        ]
        return tokens[:, 0], texts

    def localization(
        self, params: nnx.State, batch: dict, decoded: jax.Array, boxes: np.ndarray, index: np.ndarray
    ) -> tuple[int, int]:
        """`(localised words, words scored)` of the generated captions `decoded [B, T]` of a batch
        (their own attention, from a teacher-forced pass) against the true boxes `[B, K, 4]`."""
        weights = self.attention(params, {"inputs": batch["inputs"], "targets": decoded})
        # [B, T, L]
        (cross,) = [gathered(v).mean(axis=1) for k, v in weights.items() if self.roles[k] is AttentionRole.CROSS]
        captions = gathered(decoded)
        height, width = batch["inputs"].shape[1:3]
        centres = self.concrete_model.cell_centres(height, width)
        hits = total = 0
        for row in np.flatnonzero(index >= 0):
            words = int(np.argmax(captions[row] == EOS_ID)) if (captions[row] == EOS_ID).any() else captions.shape[1]
            row_hits, row_total = metrics.localization_counts(cross[row], words, boxes[row], centres)
            hits, total = hits + row_hits, total + row_total
        return hits, total

    def alignment_scores(
        self, params: nnx.State, batch: dict, spans: np.ndarray, index: np.ndarray
    ) -> dict[str, list[float]]:
        """Per cross-attention module: the alignment accuracy of each real row of a teacher-forced pass
        (heads averaged) against the task's true spans `[B, K, 4]`."""
        by_module = {}
        for module, value in self.attention(params, batch).items():
            if self.roles[module] is AttentionRole.CROSS:
                mean = gathered(value).mean(axis=1)  # [B, T, S]
                by_module[module] = [
                    metrics.alignment_accuracy(mean[row], spans[row]) for row in np.flatnonzero(index >= 0)
                ]
        return by_module


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
    localizing = run.task.boxes is not None and run.settings.tokenizer.kind == "word" and evaluator.kind.spatial
    for number, (batch, index, local) in enumerate(shown_batches(evaluator, split)):
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
            for module, module_scores in evaluator.alignment_scores(params, batch, spans, index).items():
                alignment.setdefault(module, []).extend(module_scores)
    decoded = sorted(decoded)[: max_decoded or None]
    results = metrics.summarize(jax.device_get(totals))
    results.update(text_metrics(run, split, best_hypotheses(decoded)))
    results["decoded_examples"] = len(decoded)
    results.update(alignment_results(alignment))
    if localizing:
        # no caption with as many words as boxes: nothing scored, no accuracy
        results.update({"localization_accuracy": float(localized[0] / localized[1])} if localized[1] else {})
        results["localized_words"] = int(localized[1])
    return results, decoded


def shown_batches(evaluator: Evaluator, split: str) -> Iterator[tuple[dict, np.ndarray, dict]]:
    """`evaluator.batches(split)`, its examples counted as a progress phase (`utils/progress.py`: a bar on a
    terminal, log lines otherwise) on the first process."""
    run = evaluator.run
    with progress.phase(
        f"evaluating {split}", total=len(run.task.splits[split]), unit="examples", enabled=run.is_chief
    ) as shown:
        for batch, index, local in evaluator.batches(split):
            yield batch, index, local
            # the real rows; -1 marks padding
            shown.advance(int((index >= 0).sum()))


def best_hypotheses(decoded: list[tuple[int, list[tuple[str, float]]]]) -> list[tuple[int, str]]:
    """`(record index, best hypothesis)` of each decoded example."""
    return [(index, hypotheses[0][0]) for index, hypotheses in decoded]


def text_metrics(run: Run, split: str, decoded: list[tuple[int, str]], *, signatures: bool = True) -> dict:
    """The task's text scores (scoring/score_registry.py) of the hypotheses against their references."""
    references = run.task.references(split, [i for i, _ in decoded])
    return score_registry.text_scores(
        run.task.metric,
        [h for _, h in decoded],
        references,
        bleu_tokenize=run.settings.evaluation.bleu_tokenize,
        signatures=signatures,
    )


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
    count = run.settings.evaluation.visualize_examples
    batch, index, local = next(evaluator.batches(split))
    decoded, _ = evaluator.hypotheses(params, batch, index)
    weights = {
        k: gathered(v) for k, v in evaluator.attention(params, {"inputs": batch["inputs"], "targets": decoded}).items()
    }
    inputs, hypotheses = gathered(batch["inputs"]), gathered(decoded)
    # gold, for report/pages.py
    known = {key: gathered(run.global_batch({key: local[key]})[key]) for key in ("alignment", "boxes") if key in local}
    if not run.is_chief:
        return
    drawn = {}
    directory = run.workdir / "attention" / f"step_{step}"
    kind = evaluator.kind
    for row in range(min(count, int((index >= 0).sum()))):
        output = hypotheses[row][: int(np.argmax(hypotheses[row] == EOS_ID)) + 1]
        example = pictures.example_weights(weights, evaluator.roles, row, kind.source_length(inputs[row]), len(output))
        drawn.update(
            kind.draw(
                directory,
                f"example_{row}",
                inputs[row],
                example,
                evaluator.roles,
                run.tokens.target.pieces(output),
                run.tokens,
                evaluator.concrete_model,
                self_attention=run.settings.evaluation.visualize_self_attention,
                extras={key: value[row] for key, value in known.items()},
            )
        )
    if reporter is not None:
        reporter.images(step, drawn)


def scores_by_length(run: Run, split: str, decoded: list[tuple[int, str]], width: int) -> dict:
    """The task metric per bucket of source length (in tokens), e.g. `{"0-9": {...}, "10-19": {...}}`."""
    records = run.task.splits[split]
    buckets: dict[int, list[int]] = {}
    for position, (index, _) in enumerate(decoded):
        source, _ = run.task.pair(records[index])
        buckets.setdefault(len(run.tokens.source.encode(source)) // width, []).append(position)
    by_length = {}
    for bucket in sorted(buckets):
        bucket_scores = text_metrics(run, split, [decoded[p] for p in buckets[bucket]], signatures=False)
        by_length[f"{bucket * width}-{bucket * width + width - 1}"] = {
            "examples": len(buckets[bucket]),
            **bucket_scores,
        }
    return by_length


def evaluated_params(run: Run) -> tuple[int, dict[str, nnx.State]]:
    """The restored checkpoint's step, and the parameters to evaluate by result name: the checkpoint
    (`eval_split`), and with `average_last=K > 1` also the mean of the last K (`<split>_average_last_<K>`)."""
    checkpoints, split = run.settings.checkpoints, run.settings.evaluation.eval_split
    step, params = run.restore_params(checkpoints.step_to_restore, best=checkpoints.restore_best)
    evaluated = {split: params}
    if checkpoints.average_last > 1:
        steps, averaged = run.averaged_params(checkpoints.average_last, step)
        evaluated[f"{split}_average_last_{len(steps)}"] = averaged
    run.checkpoints.close()
    return step, evaluated


def evaluate(settings: Settings, workdir: str | Path) -> dict:
    """`--mode=eval`: restores a checkpoint and evaluates `eval_split` without training.

    Returns the split's results, or with `average_last` both results by name.
    """
    run = prepare_run(settings, workdir, training=False)
    split, max_decoded = settings.evaluation.eval_split, settings.evaluation.eval_decode_examples
    check_split(run, split)
    with metric_writer.log_file(run.workdir, enabled=run.is_chief):
        step, evaluated = evaluated_params(run)
        evaluator = Evaluator(run)
        outcome = {}
        for name, params in evaluated.items():
            outcome[name], decoded = evaluate_split(evaluator, params, split, max_decoded=max_decoded)
            # the decoded examples, for the report page
            if run.is_chief:
                write_best_hypotheses(run, split, decoded, run.workdir / "predictions" / f"step_{step}_{name}.tsv")
        write_eval_results(run, step, outcome)
    return outcome[split] if len(outcome) == 1 else outcome


def predict(settings: Settings, workdir: str | Path) -> Path:
    """`--mode=predict`: decodes `eval_split` into `predictions/step_<N>.tsv` (source, reference,
    hypothesis) and writes its metrics, with the task metric by source length, to `eval/step_<N>.json`."""
    run = prepare_run(settings, workdir, training=False)
    split = settings.evaluation.eval_split
    check_split(run, split)
    with metric_writer.log_file(run.workdir, enabled=run.is_chief):
        step, evaluated = evaluated_params(run)
        # the averaged parameters when asked for
        name = list(evaluated)[-1]
        results, decoded = evaluate_split(
            Evaluator(run), evaluated[name], split, max_decoded=settings.evaluation.eval_decode_examples
        )
    path = run.workdir / "predictions" / f"step_{step}.tsv"
    if run.is_chief:
        kind = settings.source
        write_best_hypotheses(run, split, decoded, path)
        if settings.decode.num_hypotheses > 1:
            metric_writer.write_n_best(
                path.with_suffix(".nbest.tsv"), [(kind.shown(run.task, split, i), n_best) for i, n_best in decoded]
            )
        if kind.has_length:
            results["by_source_length"] = scores_by_length(
                run, split, best_hypotheses(decoded), settings.evaluation.length_bucket_width
            )
    write_eval_results(run, step, {name: results})
    return path


def write_best_hypotheses(run: Run, split: str, decoded: list[tuple[int, list[tuple[str, float]]]], path: Path) -> None:
    """The best hypothesis of each decoded example of `split` as `source<TAB>reference<TAB>hypothesis` lines
    (`evaluate_split`'s second result): `--mode=predict`'s file, and each training evaluation's for report/pages.py."""
    records, kind = run.task.splits[split], run.settings.source
    metric_writer.write_predictions(
        path,
        [
            (kind.shown(run.task, split, i), run.task.pair(records[i])[1], hypothesis)
            for i, hypothesis in best_hypotheses(decoded)
        ],
    )


def check_split(run: Run, split: str) -> None:
    if split not in run.task.splits:
        raise ConfigError(
            f"eval_split {split!r} is not a split of task {run.task.name}; valid: {', '.join(run.task.splits)}"
        )


def write_eval_results(run: Run, step: int, outcome: dict[str, dict]) -> None:
    """Eval results of a checkpoint into `eval/step_<N>.json` and metrics.jsonl (kept, not truncated;
    the rows say `"mode": "eval"`, so that training's early stopping does not count them); the
    report page rewritten."""
    if not run.is_chief:
        return
    reporter = Reporter(run.workdir, num_steps=step, start_step=step, enabled=True, truncate=False)
    for name, results in outcome.items():
        metric_writer.write_eval(run.workdir, step, name, results)
        reporter.write(step, name, {**results, "mode": "eval"})
    reporter.close()
    pages.write(run.workdir)
