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
import sacrebleu

Array = jax.Array


def cross_entropy(logits: Array, targets: Array, label_smoothing: float = 0.0) -> Array:
    """Per-token cross-entropy `[B, T]` against targets smoothed as in Szegedy et al. (2016).

    The smoothed target puts `1 - eps` on the label and spreads `eps` uniformly over
    the vocabulary (Vaswani et al. section 5.4). The constant entropy of the
    smoothed target is subtracted, so a perfect prediction of it scores 0.
    """
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    label_log_prob = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    if label_smoothing == 0.0:
        return -label_log_prob
    on, off = 1.0 - label_smoothing, label_smoothing / vocab
    smoothed = -(on * label_log_prob + off * jnp.sum(log_probs, axis=-1))  # off weight on every token, label too
    entropy = -(on + off) * math.log(on + off) - (vocab - 1) * off * math.log(off)
    return smoothed - entropy


def token_sums(logits: Array, targets: Array, label_smoothing: float = 0.0) -> dict[str, Array]:
    """Sums over non-padding target tokens (pad = 0): smoothed loss, NLL, correct argmax, count."""
    weights = (targets != 0).astype(jnp.float32)
    nll = cross_entropy(logits, targets)
    smoothed = nll if label_smoothing == 0.0 else cross_entropy(logits, targets, label_smoothing)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
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


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, str]:
    """Corpus BLEU (sacrebleu's defaults: 13a tokenisation) and its signature."""
    metric = sacrebleu.BLEU()
    score = metric.corpus_score(list(hypotheses), [list(references)])
    return score.score, str(metric.get_signature())


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, str]:
    """Corpus chrF and its signature."""
    metric = sacrebleu.CHRF()
    score = metric.corpus_score(list(hypotheses), [list(references)])
    return score.score, str(metric.get_signature())


def text_metrics(task_metric: str, hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """The task metric of decoded text: exact match (and symbol accuracy), or BLEU and chrF with their signatures."""
    if task_metric == "exact_match":
        return {
            "exact_match": exact_match(hypotheses, references),
            "symbol_accuracy": symbol_accuracy(hypotheses, references),
        }
    bleu_score, bleu_signature = bleu(hypotheses, references)
    chrf_score, chrf_signature = chrf(hypotheses, references)
    return {
        "bleu": bleu_score,
        "chrf": chrf_score,
        "bleu_signature": bleu_signature,
        "chrf_signature": chrf_signature,
        "exact_match": exact_match(hypotheses, references),
    }


# The dates target YYYY-MM-DD: which target characters belong to year, month and day (the rows
# of the task's alignment spans). The dashes have no source span and are not scored.
DATE_FIELD_POSITIONS = ((0, 1, 2, 3), (5, 6), (8, 9))


def alignment_accuracy(weights, spans) -> float:
    """Share of scored target positions whose most-attended source position lies in the true span.

    Args:
      weights: `[T, S]` attention of one example (target positions over source positions).
      spans: `[3, 2]` `[start, end)` source spans of year, month and day (the dates task's `alignment`).
    """
    hits, total = 0, 0
    for positions, (start, end) in zip(DATE_FIELD_POSITIONS, spans):
        for position in positions:
            if position < len(weights):
                hits += int(start <= int(weights[position].argmax()) < end)
                total += 1
    return hits / max(total, 1)


def alignment_error_rate(predicted: set, sure: set, possible: set) -> float:
    """Och and Ney (2003) AER: `1 - (|A & S| + |A & P|) / (|A| + |S|)`, with S a subset of P.

    Alignments are sets of (source, target) index pairs.
    """
    possible = possible | sure
    return 1.0 - (len(predicted & sure) + len(predicted & possible)) / max(len(predicted) + len(sure), 1)
