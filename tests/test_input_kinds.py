"""The input kinds (run_setup/input_kinds.py): each turns a user's sources into model inputs and batches, checks
them, and the run's kind follows from its model; a feature-grid captioner decodes through its kind."""

import jax
import numpy as np
import pytest
from flax import nnx

import models
from configs import base
from helpers.tiny import tiny_config
from run_setup import input_kinds
from run_setup.settings import parse
from scoring import decoding
from tasks import vocabularies as tk
from utils.errors import ConfigError, UserError

CHARS = tk.CharTokenizer.train(["abcd"], 10**6)
TOKENS = tk.Tokenizers(CHARS, CHARS)


def test_every_kind_is_registered_under_its_name_and_a_run_gets_its_models_kind():
    assert {name: kind.name for name, kind in input_kinds.KINDS.items()} == {
        "text": "text",
        "image": "image",
        "features": "features",
    }
    assert parse(tiny_config("unused")).source is input_kinds.KINDS["text"]
    captioner = tiny_config(
        "unused", task=base.task("digit_strips"), model=base.model("captioner"), **{"data.batching": "bucket"}
    )
    assert parse(captioner).source is input_kinds.KINDS["image"]
    captioner.model.update(inputs="features", feature_dim=8)
    assert parse(captioner).source is input_kinds.KINDS["features"]


def test_text_sources_become_ids_ending_in_eos_padded_to_a_power_of_two():
    text = input_kinds.KINDS["text"]
    rows = text.user_rows(["ab", "abcd"], {}, TOKENS, max_source_length=4)
    a, b = (CHARS.encode(c)[0] for c in "ab")
    # trimmed to 4 with eos
    assert [list(r) for r in rows] == [[a, b, tk.EOS_ID], [a, b, *CHARS.encode("c"), tk.EOS_ID]]
    batch = text.user_batch(rows, 3, length_limit=16)
    # 4 ids -> the next power of two above 4
    assert batch.shape == (3, 8) and batch.dtype == np.int32
    assert list(batch[0]) == [a, b, tk.EOS_ID, 0, 0, 0, 0, 0] and not batch[2].any()
    assert text.source_length(batch[0]) == 3 and text.has_length and text.packs
    with pytest.raises(UserError, match="give strings"):
        text.user_rows([np.zeros((2, 2))], {}, TOKENS, 4)


def test_images_get_their_channel_and_wrong_ones_are_named():
    image = input_kinds.KINDS["image"]
    (row,) = image.user_rows([np.full((3, 4), 7, np.uint8)], {"channels": 1}, TOKENS, 8)
    assert row.shape == (3, 4, 1) and image.source_length(row) is None and not image.packs
    with pytest.raises(UserError, match=r"uint8 \[H, W, 3\]"):
        image.user_rows([np.zeros((3, 4), np.uint8)], {"channels": 3}, TOKENS, 8)
    with pytest.raises(UserError, match="not text"):
        image.user_rows(["a caption"], {"channels": 1}, TOKENS, 8)
    with pytest.raises(UserError, match="one shape"):
        image.user_batch([np.zeros((2, 2, 1), np.uint8), np.zeros((3, 2, 1), np.uint8)], 4, 8)


def test_a_feature_grid_captioner_decodes_a_users_grids_through_its_kind():
    features = input_kinds.KINDS["features"]
    model = models.create_model(
        "captioner",
        rngs=nnx.Rngs(0),
        vocab_size=9,
        embed_dim=4,
        hidden_dim=6,
        attention_dim=4,
        inputs="features",
        feature_dim=3,
    )
    grids = [np.random.default_rng(0).normal(size=(5, 3)), np.ones((5, 3))]
    rows = features.user_rows(grids, {"feature_dim": 3}, TOKENS, 8)
    batch = features.user_batch(rows, 4, 8)
    assert batch.shape == (4, 5, 3) and batch.dtype == np.float32 and np.array_equal(batch[1], np.ones((5, 3)))
    tokens, scores = decoding.decode(
        model,
        jax.numpy.asarray(batch),
        length=6,
        key=jax.random.key(0),
        method="search",
        beam_size=1,
        alpha=0.0,
        num_hypotheses=1,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_length_offset=0,
    )
    assert tokens.shape == (4, 1, 6) and np.all(np.isfinite(np.asarray(scores)))
    with pytest.raises(UserError, match=r"\[L, 3\] \(model.feature_dim\)"):
        features.user_rows([np.ones((5, 4))], {"feature_dim": 3}, TOKENS, 8)


def test_a_task_and_a_model_of_different_kinds_are_refused_by_name():
    with pytest.raises(ConfigError, match="task 'dates' has text sources, but model 'captioner' reads image"):
        parse(tiny_config("unused", model=base.model("captioner"), **{"data.batching": "bucket"}))
