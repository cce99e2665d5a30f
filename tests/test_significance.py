"""scoring/significance.py against hand-worked cases: the buckets of source lengths, BLEU's
statistics and its bootstrap interval, and the paired bootstrap's p-values at the extremes."""

import pytest
import sacrebleu

from scoring import significance


def test_buckets_of_ten_words_hold_their_lengths_and_keep_empty_ones():
    # 1-10: sentences 0, 1 (and a length of 0); 11-20: none; 21-30: sentence 3
    assert significance.length_buckets([3, 10, 25, 0], 10) == [(1, 10, [0, 1, 3]), (11, 20, []), (21, 30, [2])]
    assert significance.length_buckets([11], 10) == [(1, 10, []), (11, 20, [0])]
    assert significance.length_buckets([], 10) == []


def test_sentence_statistics_sum_to_sacrebleus_corpus_bleu():
    hypotheses = ["the cat sat on the mat", "a dog barked loudly", "in the beginning"]
    references = ["the cat sat on a mat", "the dog barked", "in the beginning god created"]
    statistics = significance.sentence_statistics(hypotheses, references)
    # "the cat sat on the mat" against "the cat sat on a mat": 6 words each, 5 unigrams matched of 6,
    # 3 bigrams of 5 (the cat, cat sat, sat on), 2 trigrams of 4, 1 four-gram of 3
    assert statistics[0].tolist() == [6, 6, 5, 3, 2, 1, 6, 5, 4, 3]
    expected = sacrebleu.corpus_bleu(hypotheses, [references]).score
    assert significance.bleu_of(statistics) == pytest.approx(expected)


def test_a_bucket_of_one_sentence_has_its_score_as_its_interval():
    statistics = significance.sentence_statistics(["the cat sat on the mat"], ["the cat sat on a mat"])
    bleu = significance.bleu_of(statistics)
    # the one resample is the sentence itself
    assert significance.bootstrap_interval(statistics, resamples=50) == pytest.approx((bleu, bleu))


def test_every_hypothesis_equal_to_its_reference_scores_100_with_no_spread():
    sentences = ["and god said let there be light", "and there was light", "the evening and the morning"]
    statistics = significance.sentence_statistics(sentences, sentences)
    (bucket,) = significance.bleu_by_length(statistics, [7, 4, 5], resamples=100)
    assert (bucket.low, bucket.high, bucket.sentences) == (1, 10, 3)
    assert bucket.bleu == pytest.approx(100.0) and bucket.interval == pytest.approx((100.0, 100.0))


def test_one_perfect_and_one_wrong_sentence_spread_over_the_whole_range():
    """Resamples of two sentences: both the perfect one (1/4: BLEU 100), both the wrong one (1/4: 0), one
    of each (1/2). A quarter of the mass at each end: the 95% interval is [0, 100]."""
    statistics = significance.sentence_statistics(
        ["let there be light upon the waters", "xx yy zz qq"], ["let there be light upon the waters", "aa bb cc dd"]
    )
    assert significance.bleu_of(statistics[[0, 0]]) == pytest.approx(100.0)
    assert significance.bleu_of(statistics[[1, 1]]) == 0.0
    assert significance.bootstrap_interval(statistics, resamples=400) == pytest.approx((0.0, 100.0))


def test_bleu_by_length_reports_an_empty_bucket_without_a_score():
    statistics = significance.sentence_statistics(["a b c", "d e f"], ["a b c", "d e g"])
    buckets = significance.bleu_by_length(statistics, [5, 25], resamples=20)
    assert [(b.low, b.sentences, b.bleu is None, b.interval is None) for b in buckets] == [
        (1, 1, False, False),
        (11, 0, True, True),
        (21, 1, False, False),
    ]


def test_paired_bootstrap_against_itself_and_against_the_references():
    references = [f"sentence number {i} of the test split" for i in range(40)]
    garbled = [f"words {i} unrelated" for i in range(40)]
    # the same output: no difference at all, never a significant one
    same = significance.paired_bootstrap(garbled, garbled, references, resamples=200)
    assert same["bleu_p"] == pytest.approx(1.0) and same["chrf_p"] == pytest.approx(1.0)
    # the references themselves against garbled output: no resample's centred difference (about 0)
    # exceeds the observed one (100 BLEU), the smallest p-value, 1 / (200 + 1)
    apart = significance.paired_bootstrap(garbled, references, references, resamples=200)
    assert apart == pytest.approx({"bleu_p": 1 / 201, "chrf_p": 1 / 201})


def test_seeds_summed_sentence_by_sentence_score_as_one_corpus():
    references = ["the cat sat on a mat", "the dog barked"]
    seeds = [["the cat sat on the mat", "a dog barked"], ["the cat sat on a mat", "the dog"]]
    summed = sum(significance.sentence_statistics(h, references) for h in seeds)
    # the four outputs as one corpus of four sentences
    pooled = sacrebleu.corpus_bleu(seeds[0] + seeds[1], [references + references]).score
    (bucket,) = significance.bleu_by_length(summed, [6, 3], resamples=50)
    assert bucket.bleu == pytest.approx(pooled) and bucket.sentences == 2
