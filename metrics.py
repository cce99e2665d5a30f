"""Losses and metrics: cross-entropy with label smoothing, token accuracy, perplexity,
exact match, and BLEU / chrF through sacrebleu (on detokenised text).

The array functions return sums and counts so that batches, devices and
processes combine by addition; `summarize` turns the totals into means.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from vocabularies import PAD_ID

Array = jax.Array


def cross_entropy(logits: Array, targets: Array, label_smoothing: float = 0.0) -> Array:
    """Per-token cross-entropy `[B, T]` against targets smoothed as in Szegedy et al. (2016).

    The smoothed target puts `1 - eps` on the label and spreads `eps` uniformly over
    the vocabulary (Vaswani et al. section 5.4). The constant entropy of the
    smoothed target is subtracted, so a perfect prediction of it scores 0.
    """
    logits = logits.astype(jnp.float32)
    log_partition = _log_partition(logits, jnp.max(logits, axis=-1, keepdims=True))
    return _smoothed_nll(logits, _target_logits(logits, targets), log_partition, label_smoothing)


def _log_partition(logits: Array, largest: Array) -> Array:
    """`log sum_v exp(z_v)` `[...]`, shifted by the (constant) largest logit `[..., 1]` for range."""
    largest = jax.lax.stop_gradient(largest)
    return largest[..., 0] + jnp.log(jnp.sum(jnp.exp(logits - largest), axis=-1))


def _target_logits(logits: Array, targets: Array) -> Array:
    """`z_y`: `[..., V], [...] -> [...]`."""
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _smoothed_nll(logits: Array, target_logits: Array, log_partition: Array, label_smoothing: float) -> Array:
    """`-(on * log p_y + off * sum_v log p_v) - entropy`, with `log p_v = z_v - log Z`.

    Written with `log Z` instead of a `[..., V]` array of log-probabilities: no
    log-softmax array is made, and its gradient `softmax - target` comes out of
    one pass over the logits (a kjv_web_transformer step: 8,192 x 8,000 logits).
    """
    nll = log_partition - target_logits
    if label_smoothing == 0.0:
        return nll
    vocab = logits.shape[-1]
    on, off = 1.0 - label_smoothing, label_smoothing / vocab
    entropy = -(on + off) * math.log(on + off) - (vocab - 1) * off * math.log(off)
    return on * nll + off * (vocab * log_partition - jnp.sum(logits, axis=-1)) - entropy


def token_sums(logits: Array, targets: Array, label_smoothing: float = 0.0) -> dict[str, Array]:
    """Sums over non-padding target tokens: smoothed loss, NLL, correct (argmax) predictions, count."""
    weights = (targets != PAD_ID).astype(jnp.float32)
    logits = logits.astype(jnp.float32)
    largest = jnp.max(logits, axis=-1, keepdims=True)
    log_partition = _log_partition(logits, largest)
    target_logits = _target_logits(logits, targets)
    nll = log_partition - target_logits
    smoothed = _smoothed_nll(logits, target_logits, log_partition, label_smoothing)
    # Correct: the target's logit is the largest; of k tied largest logits it counts 1/k, the
    # argmax's chance of naming it with ties broken at random. Plain reductions, not an argmax:
    # XLA:CPU runs that variadic reduce apart, a sixth of a kjv_web_transformer step.
    ties = jnp.sum(logits == largest, axis=-1)
    correct = (target_logits >= largest[..., 0]) / ties
    return {
        "smoothed_loss_sum": jnp.sum(smoothed * weights),
        "nll_sum": jnp.sum(nll * weights),
        "correct_sum": jnp.sum(correct * weights),
        "tokens": jnp.sum(weights),
    }


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Token sums -> `loss` (NLL per token), `perplexity`, `token_accuracy`."""
    tokens = max(float(sums["tokens"]), 1.0)
    loss = float(sums["nll_sum"]) / tokens
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "token_accuracy": float(sums["correct_sum"]) / tokens,
    }


def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Share of hypotheses equal to their reference."""
    return sum(h == r for h, r in zip(hypotheses, references, strict=True)) / max(len(references), 1)


def symbol_accuracy(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Share of symbols right at their position, over the longer of hypothesis and reference.

    Partial credit where exact match gives none: a 100-symbol copy with one
    symbol wrong scores 0.99, one cut short by half scores 0.5.
    """
    right = total = 0
    for hypothesis, reference in zip(hypotheses, references, strict=True):
        right += sum(h == r for h, r in zip(hypothesis, reference))
        total += max(len(hypothesis), len(reference))
    return right / max(total, 1)


# sacreBLEU's tokenizers that need no extra download or package (ja-mecab, ko-mecab and the
# SentencePiece ones do).
BLEU_TOKENIZERS = ("13a", "intl", "zh", "char", "none")


def bleu(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> tuple[float, str]:
    """Corpus BLEU with sacreBLEU's `tokenize` (13a, its default) and its signature."""
    metric = sacrebleu.BLEU(tokenize=tokenize)
    score = metric.corpus_score(list(hypotheses), [list(references)])
    return score.score, str(metric.get_signature())


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, str]:
    """Corpus chrF and its signature."""
    metric = sacrebleu.CHRF()
    score = metric.corpus_score(list(hypotheses), [list(references)])
    return score.score, str(metric.get_signature())


def caption_metrics(hypotheses: Sequence[str], references: Sequence[Sequence[str]], tokenize: str = "13a") -> dict:
    """Captioning's metrics over several references per hypothesis: corpus BLEU-1 to BLEU-4
    (sacreBLEU, `bleu` = BLEU-4, as Xu et al. report them) and exact match with any reference."""
    streams = max(map(len, references), default=1)
    padded = [list(refs) + [None] * (streams - len(refs)) for refs in references]  # sacreBLEU skips None
    results = {}
    for order in range(1, 5):
        metric = sacrebleu.BLEU(tokenize=tokenize, max_ngram_order=order)
        results[f"bleu_{order}"] = metric.corpus_score(list(hypotheses), [list(s) for s in zip(*padded)]).score
    results["bleu"] = results["bleu_4"]
    results["bleu_signature"] = str(metric.get_signature())
    results["exact_match"] = sum(h in refs for h, refs in zip(hypotheses, references, strict=True)) / max(len(references), 1)
    return results


def text_metrics(task_metric: str, hypotheses: Sequence[str], references: Sequence[str], bleu_tokenize: str = "13a") -> dict:
    """The task metric of decoded text: exact match (and symbol accuracy), or BLEU and chrF with their
    signatures (captioning's metrics over several references are `caption_metrics`)."""
    if task_metric == "exact_match":
        return {
            "exact_match": exact_match(hypotheses, references),
            "symbol_accuracy": symbol_accuracy(hypotheses, references),
        }
    bleu_score, bleu_signature = bleu(hypotheses, references, bleu_tokenize)
    chrf_score, chrf_signature = chrf(hypotheses, references)
    return {
        "bleu": bleu_score,
        "chrf": chrf_score,
        "bleu_signature": bleu_signature,
        "chrf_signature": chrf_signature,
        "exact_match": exact_match(hypotheses, references),
    }


def alignment_accuracy(weights, spans) -> float:
    """Share of aligned target positions whose most-attended source position lies in the true span.

    Args:
      weights: `[T, S]` attention of one example (target positions over source positions).
      spans: `[K, 4]` rows `(target start, target end, source start, source end)`: the target
        positions `[t0, t1)` are produced from the source positions `[s0, s1)` (`tasks.Task.alignment`).
        Target positions in no span, or past the end of `weights`, are not scored.
    """
    hits, total = 0, 0
    for target_start, target_end, source_start, source_end in np.asarray(spans):
        for position in range(target_start, min(target_end, len(weights))):
            hits += int(source_start <= int(np.argmax(weights[position])) < source_end)
            total += 1
    return hits / max(total, 1)


def localization_counts(weights, words: int, boxes, centres) -> tuple[int, int]:
    """`(localised words, words scored)` of one generated caption: when it has as many words as the
    image has boxes, the i-th word is matched with the i-th box, and counts as localised when the
    centre of its most-attended annotation cell lies inside that box. Otherwise nothing is scored.

    Args:
      weights: `[T, L]` the caption's attention over the annotation grid (a word per step).
      words: the caption's words (its steps before eos).
      boxes: `[K, 4]` `(x0, y0, x1, y1)` in pixels, end exclusive, -1 rows: none.
      centres: `[L, 2]` each cell's centre `(x, y)` in pixels.
    """
    boxes = np.asarray(boxes)
    boxes = boxes[boxes[:, 0] >= 0]
    if words != len(boxes) or words == 0:
        return 0, 0
    hits = 0
    for step, (x0, y0, x1, y1) in enumerate(boxes):
        x, y = centres[int(np.argmax(weights[step]))]
        hits += int(x0 <= x < x1 and y0 <= y < y1)
    return hits, words
