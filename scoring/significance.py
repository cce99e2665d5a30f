"""Scores with their uncertainty: corpus BLEU by source-length bucket with a bootstrap interval
(Bahdanau et al.'s figure 2, with error bars), and paired bootstrap resampling between two systems
on the same sentences (sacrebleu's own test, Koehn 2004).

The bootstrap resamples a bucket's sentences with replacement and scores each resample as a corpus
(the n-gram counts summed, then BLEU): the interval is the 2.5th and 97.5th percentiles of those
scores. A bucket of one sentence has one possible resample, so its interval is its score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest


@dataclass(frozen=True)
class BucketScore:
    """One bucket of source lengths `[low, high]` (words): its sentences, their corpus BLEU and the
    bootstrap interval (`None` for an empty bucket)."""

    low: int
    high: int
    sentences: int
    bleu: float | None
    interval: tuple[float, float] | None


def length_buckets(lengths: Sequence[int], width: int = 10) -> list[tuple[int, int, list[int]]]:
    """`(low, high, sentence indices)` of each bucket `[1, width]`, `[width + 1, 2 width]`, ... up to the
    longest sentence's, empty ones included (a length of 0 counts in the first)."""
    if not lengths:
        return []
    count = max(1, -(-max(lengths) // width))
    members: list[list[int]] = [[] for _ in range(count)]
    for index, length in enumerate(lengths):
        members[max(length - 1, 0) // width].append(index)
    return [(k * width + 1, (k + 1) * width, members[k]) for k in range(count)]


def sentence_statistics(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> np.ndarray:
    """BLEU's sufficient statistics of each sentence `[N, 10]`: hypothesis and reference lengths, then the
    matched and total n-grams of orders 1 to 4 (what corpus BLEU sums over sentences)."""
    bleu = BLEU(tokenize=tokenize)
    return np.asarray(bleu._extract_corpus_statistics(list(hypotheses), [list(references)]), dtype=np.int64)


def bleu_of(statistics: np.ndarray, tokenize: str = "13a") -> float:
    """Corpus BLEU of the sentences whose statistics are the rows of `statistics` `[N, 10]`."""
    return float(BLEU(tokenize=tokenize)._compute_score_from_stats(statistics.sum(axis=0).tolist()).score)


def bootstrap_interval(
    statistics: np.ndarray, *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0, tokenize: str = "13a"
) -> tuple[float, float]:
    """The percentile interval of corpus BLEU over `resamples` resamples (with replacement) of the
    sentences `[N, 10]`."""
    rng = np.random.default_rng(seed)
    chosen = rng.integers(0, len(statistics), size=(resamples, len(statistics)))
    scores = np.array([bleu_of(statistics[rows], tokenize) for rows in chosen])
    tail = 100 * (1 - confidence) / 2
    return float(np.percentile(scores, tail)), float(np.percentile(scores, 100 - tail))


def bleu_by_length(
    statistics: np.ndarray,
    source_lengths: Sequence[int],
    *,
    width: int = 10,
    resamples: int = 1000,
    seed: int = 0,
    tokenize: str = "13a",
) -> list[BucketScore]:
    """Corpus BLEU of each bucket of source lengths (`length_buckets`) with its bootstrap interval, from
    each sentence's statistics `[N, 10]` (`sentence_statistics`; several systems' outputs of the same
    sentences, e.g. seeds, summed sentence by sentence: the resamples keep a sentence's outputs together)."""
    scores = []
    for low, high, members in length_buckets(list(source_lengths), width):
        if not members:
            scores.append(BucketScore(low, high, 0, None, None))
            continue
        rows = statistics[members]
        interval = bootstrap_interval(rows, resamples=resamples, seed=seed, tokenize=tokenize)
        scores.append(BucketScore(low, high, len(members), bleu_of(rows, tokenize), interval))
    return scores


def paired_bootstrap(
    baseline: Sequence[str],
    system: Sequence[str],
    references: Sequence[str],
    *,
    resamples: int = 1000,
    tokenize: str = "13a",
) -> dict[str, float]:
    """sacrebleu's paired bootstrap resampling of `system` against `baseline` on the same sentences:
    `{"bleu_p", "chrf_p"}`, each the probability of a difference at least as large as the observed
    one arising by chance (small: the difference is real). Its smallest value is 1 / (resamples + 1).

    Identical outputs get 1: sacrebleu counts the resamples whose centred difference is strictly above
    the observed one, which for a difference of exactly 0 everywhere is none, its smallest p-value."""
    if list(baseline) == list(system):
        return {"bleu_p": 1.0, "chrf_p": 1.0}
    test = PairedTest(
        [("baseline", list(baseline)), ("system", list(system))],
        {"BLEU": BLEU(tokenize=tokenize), "chrF": CHRF()},
        [list(references)],
        test_type="bs",
        n_samples=resamples,
    )
    # sacrebleu seeds its resampling itself (SACREBLEU_SEED, 12345 by default): the same p-values each run
    _, results = test()
    # keyed by each metric's own name: "chrF2" for chrF with beta 2
    bleu, chrf = (results[name][1].p_value for name in results if name != "System")
    return {"bleu_p": float(bleu), "chrf_p": float(chrf)}
