"""Tokenizers: fixed special ids, round trips, training limits, save and reload."""

import dataclasses

import numpy as np
import pytest

from configs import base
from run_setup.settings import TokenizerSettings, parse
from tasks import vocabularies as tk
from utils.errors import ConfigError, DataError


def settings(**fields):
    """configs/base.py's tokenizer settings, with `fields` changed."""
    return dataclasses.replace(parse(base.get_config()).tokenizer, **fields)


CORPUS = [
    ("the cat sat on the mat", "die Katze sass auf der Matte"),
    ("the dog ran to the tree", "der Hund lief zum Baum"),
    ("a bird sang in the morning", "ein Vogel sang am Morgen"),
] * 20


def test_char_tokenizer_round_trip_and_special_ids():
    tokenizer = tk.CharTokenizer.train(["ab c", "cba"], max_corpus_chars=100)
    assert tokenizer.chars == " abc"
    assert tokenizer.vocab_size == 8
    ids = tokenizer.encode("cab a")
    # ' '=4, a=5, b=6, c=7
    np.testing.assert_array_equal(ids, [7, 5, 6, 4, 5])
    # stops at eos
    assert tokenizer.decode([tk.BOS_ID, *ids, tk.EOS_ID, 5, tk.PAD_ID]) == "cab a"
    np.testing.assert_array_equal(tokenizer.encode("ax"), [5, tk.UNK_ID])
    assert tokenizer.pieces([0, 1, 2, 3, 5]) == ["<pad>", "<s>", "</s>", "<unk>", "a"]


def test_char_tokenizer_reads_at_most_max_corpus_chars():
    tokenizer = tk.CharTokenizer.train(["abc", "def", "xyz"], max_corpus_chars=4)
    # the second text starts below the budget; the third does not
    assert tokenizer.chars == "abcdef"


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_sentencepiece_round_trip_and_special_ids(model_type):
    texts = [text for pair in CORPUS for text in pair]
    tokenizer = tk.SentencePieceTokenizer.train(texts, vocab_size=60, model_type=model_type, max_corpus_chars=10**6)
    assert tokenizer.pieces([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    for text in ("the cat sat on the mat", "der Hund lief zum Baum"):
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int32 and ids.min() > tk.UNK_ID
        assert tokenizer.decode([*ids, tk.EOS_ID, *ids]) == text


def test_tokenizers_are_saved_reloaded_and_checked(tmp_path):
    sentencepiece = settings(kind="sentencepiece", vocab_size=50, shared=False)
    trained = tk.load_or_train(tmp_path, sentencepiece, CORPUS)
    assert trained.source is not trained.target
    assert "Katze" not in "".join(trained.source.pieces(range(trained.source.vocab_size)))
    # no text needed: read from the directory
    reloaded = tk.load_or_train(tmp_path, sentencepiece)
    for text in ("the cat sat", "die Katze"):
        np.testing.assert_array_equal(reloaded.source.encode(text), trained.source.encode(text))
        np.testing.assert_array_equal(reloaded.target.encode(text), trained.target.encode(text))
    with pytest.raises(DataError, match="trained with"):
        tk.load_or_train(tmp_path, settings(kind="char"))


def test_shared_vocabulary_is_one_tokenizer(tmp_path):
    shared = tk.load_or_train(tmp_path, settings(kind="char", shared=True), CORPUS)
    assert shared.source is shared.target
    assert set("KzH") <= set(shared.source.chars)


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="tokenizer.kind"):
        settings(kind="words")
    with pytest.raises(DataError, match="no tokenizer"):
        tk.load_or_train("/nonexistent/tokenizer", settings())


def test_a_vocabulary_shelved_beside_the_data_is_copied_into_a_new_workdir_not_trained_again(tmp_path):
    settings = TokenizerSettings(
        kind="char", vocab_size=8000, model_type="unigram", shared=True, max_corpus_chars=10**6
    )
    first = tk.load_or_train(tmp_path / "run1" / "tokenizer", settings, [("abc", "cab")], shelf=tmp_path / "shelf")
    # no text: shelved
    second = tk.load_or_train(tmp_path / "run2" / "tokenizer", settings, iter(()), shelf=tmp_path / "shelf")
    assert second.digest == first.digest and (tmp_path / "run2" / "tokenizer" / "checksums.json").exists()
    other = dataclasses.replace(settings, max_corpus_chars=2)
    assert (
        tk.load_or_train(tmp_path / "run3" / "tokenizer", other, [("xyz", "zyx")], shelf=tmp_path / "shelf").digest
        != first.digest
    )


@pytest.mark.parametrize("shared", [True, False])
def test_the_vocabulary_learns_from_a_streamed_sample_as_from_every_pair(shared):
    pairs = [(f"source {i} " + "ab" * (i % 7), f"target {i} " + "xyz" * (i % 5)) for i in range(200)]
    chosen = settings(kind="word", vocab_size=60, shared=shared, max_corpus_chars=900)

    # fails if read further than the sample needs
    def stream():
        for i, pair in enumerate(pairs):
            yield pair
            if i > 60:
                pytest.fail("read past the sample")

    sample = tk.sample(stream(), 900, shared=shared)
    sides = [sum(len(text) for text in side) for side in zip(*sample[:-1])]
    # one pair fewer would not do
    assert (sum(sides) < 900) if shared else min(sides) < 900
    # every pair in memory, as before
    reference = tk._trained(chosen, pairs)
    assert [t.words for t in tk._trained(chosen, sample)] == [t.words for t in reference]
