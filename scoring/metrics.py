"""The math of the scores: cross-entropy with label smoothing, token accuracy, perplexity,
exact match, symbol accuracy, BLEU / chrF through sacrebleu (on detokenised text), alignment
and localisation accuracy. Which scores exist, their direction and the tasks they apply to
are declared in `scoring/score_registry.py`.

The array functions return sums and counts so that batches, devices and
processes combine by addition; `summarize` turns the totals into means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tasks.vocabularies import PAD_ID

# sacrebleu is imported by the functions that score text, not here: it imports lxml for its WMT
# readers, 0.08-0.12 s of every train.py start (`python -X importtime`), which scores no text until its
# first evaluation

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
    # XLA:CPU runs the argmax's variadic reduce apart, a sixth of a kjv_web_transformer step
    # (docs/performance.md, "What each choice is worth").
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


def exact_match(hypotheses: Sequence[str], references: Sequence[str | Sequence[str]]) -> float:
    """Share of hypotheses equal to their reference (or, given several, to any of them)."""
    hits = sum(h in _alternatives(r) for h, r in zip(hypotheses, references, strict=True))
    return hits / max(len(references), 1)


def _alternatives(reference: str | Sequence[str]) -> Sequence[str]:
    """A hypothesis's references: one string, or a sequence of them."""
    return (reference,) if isinstance(reference, str) else reference


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


def bleu(
    hypotheses: Sequence[str],
    references: Sequence[str | Sequence[str]],
    tokenize: str = "13a",
    max_ngram_order: int = 4,
) -> tuple[float, str]:
    """Corpus BLEU with sacreBLEU's `tokenize` (13a, its default) over n-grams up to `max_ngram_order`
    (4: BLEU-4), and its signature. Each hypothesis has one reference or several (captioning:
    every caption of an image); sacreBLEU's signature then says `nrefs:var`."""
    import sacrebleu

    metric = sacrebleu.BLEU(tokenize=tokenize, max_ngram_order=max_ngram_order)
    score = metric.corpus_score(list(hypotheses), _reference_streams(hypotheses, references))
    return score.score, str(metric.get_signature())


def chrf(hypotheses: Sequence[str], references: Sequence[str | Sequence[str]]) -> tuple[float, str]:
    """Corpus chrF and its signature; each hypothesis has one reference or several."""
    import sacrebleu

    metric = sacrebleu.CHRF()
    score = metric.corpus_score(list(hypotheses), _reference_streams(hypotheses, references))
    return score.score, str(metric.get_signature())


def _reference_streams(hypotheses: Sequence[str], references: Sequence[str | Sequence[str]]) -> list[list[str | None]]:
    """sacreBLEU's reference streams: the i-th reference of every hypothesis, None where it has fewer
    (sacreBLEU skips None)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    alternatives = [list(_alternatives(r)) for r in references]
    streams = max(map(len, alternatives), default=1)
    return [[refs[i] if i < len(refs) else None for refs in alternatives] for i in range(streams)]


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
