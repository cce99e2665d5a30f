"""Losses and metrics against NumPy and sacrebleu references."""

import math

import numpy as np
import sacrebleu

from scoring import metrics


def np_smoothed_cross_entropy(logits, target, eps):
    logits = np.float64(logits)
    log_probs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    vocab = len(logits)
    q = np.full(vocab, eps / vocab)
    q[target] += 1 - eps
    entropy = -sum(p * math.log(p) for p in q if p > 0)
    # cross-entropy minus the entropy of q
    return -(q * log_probs).sum() - entropy


def test_cross_entropy_with_and_without_label_smoothing():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    targets = rng.integers(0, 7, size=(2, 3))
    for eps in (0.0, 0.1):
        got = np.asarray(metrics.cross_entropy(logits, targets, eps))
        for b in range(2):
            for t in range(3):
                assert math.isclose(
                    got[b, t], np_smoothed_cross_entropy(logits[b, t], targets[b, t], eps), rel_tol=1e-5
                )


def test_smoothed_loss_is_zero_at_the_smoothed_target():
    eps, vocab = 0.1, 5
    q = np.full(vocab, eps / vocab)
    q[2] += 1 - eps
    loss = metrics.cross_entropy(np.log(q)[None].astype(np.float32), np.array([2]), eps)
    assert abs(float(loss[0])) < 1e-6


def test_token_sums_ignore_padding_and_summarize():
    logits = np.log(np.array([[[0.7, 0.1, 0.2], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]], np.float32))
    # the last position is padding
    targets = np.array([[1, 2, 0]])
    sums = {k: float(v) for k, v in metrics.token_sums(logits, targets).items()}
    assert sums["tokens"] == 2
    # argmaxes are 0 and 1
    assert sums["correct_sum"] == 0
    assert math.isclose(sums["nll_sum"], -math.log(0.1) - math.log(0.3), rel_tol=1e-5)
    summary = metrics.summarize(sums)
    assert math.isclose(summary["loss"], sums["nll_sum"] / 2, rel_tol=1e-6)
    assert math.isclose(summary["perplexity"], math.sqrt(1 / (0.1 * 0.3)), rel_tol=1e-5)
    assert summary["token_accuracy"] == 0


def test_token_accuracy_counts_the_target_among_k_tied_largest_logits_as_one_kth():
    logits = np.array(
        [[[0.0, 1.0, 3.0, 2.0], [0.0, 2.0, 2.0, 0.0], [0.0, 4.0, 4.0, 4.0], [0.0, 0.0, 1.0, 1.0]]], np.float32
    )
    # right; one of two tied; one of three tied; not among the largest (id 0 is padding)
    targets = np.array([[2, 1, 3, 1]])
    assert math.isclose(float(metrics.token_sums(logits, targets)["correct_sum"]), 1 + 1 / 2 + 1 / 3, rel_tol=1e-6)


def test_exact_match_and_bleu_equal_sacrebleu():
    hypotheses = ["the cat sat on the mat", "a dog barked", "it rains"]
    references = ["the cat sat on the mat", "the dog barked loudly", "it is raining"]
    assert metrics.exact_match(hypotheses, references) == 1 / 3
    score, signature = metrics.bleu(hypotheses, references)
    assert score == sacrebleu.corpus_bleu(hypotheses, [references]).score
    assert signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert metrics.chrf(hypotheses, references)[0] == sacrebleu.corpus_chrf(hypotheses, [references]).score


def test_symbol_accuracy_hand_worked():
    # "abcd" vs "abxd": 3 of 4; "ab" vs "abcd": 2 of 4; "abcde" vs "abc": 3 of 5; "" vs "": nothing counted
    assert metrics.symbol_accuracy(["abxd", "ab", "abcde", ""], ["abcd", "abcd", "abc", ""]) == (3 + 2 + 3) / (
        4 + 4 + 5
    )
    assert metrics.symbol_accuracy([], []) == 0.0


def test_bleu_chrf_and_exact_match_over_several_references_equal_sacrebleu():
    hypotheses = ["a dog runs", "two cats"]
    references = [["a dog runs fast", "a dog runs"], ["one cat"]]
    # sacreBLEU skips None
    streams = [["a dog runs fast", "one cat"], ["a dog runs", None]]
    assert metrics.exact_match(hypotheses, references) == 1 / 2
    for order in (1, 4):
        expected = sacrebleu.BLEU(tokenize="char", max_ngram_order=order)
        score, signature = metrics.bleu(hypotheses, references, "char", max_ngram_order=order)
        assert score == expected.corpus_score(hypotheses, streams).score
        assert signature == str(expected.get_signature()) and signature.startswith("nrefs:var|")
    assert metrics.chrf(hypotheses, references)[0] == sacrebleu.CHRF().corpus_score(hypotheses, streams).score
    # one reference each, as strings or as lists of one: the same
    assert metrics.bleu(hypotheses, ["a dog runs", "one cat"]) == metrics.bleu(
        hypotheses, [["a dog runs"], ["one cat"]]
    )
