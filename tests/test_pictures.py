"""Attention pictures and alignment metrics."""

import numpy as np
import pytest
from flax import nnx

import models
from models.attention import AttentionRole, attention_roles, capture_attention
from report import pictures
from scoring import metrics
from tasks import dates


def test_alignment_accuracy_hand_worked():
    # source "3 Jan 2021": day at 0, month at 2-5, year at 6-10; target "2021-01-03"
    spans = dates.alignment_spans({"alignment": np.array([[6, 10], [2, 5], [0, 1]])})
    np.testing.assert_array_equal(spans, [[0, 4, 6, 10], [5, 7, 2, 5], [8, 10, 0, 1]])
    weights = np.zeros((11, 10))
    # per target position
    most_attended = [6, 7, 8, 1, 0, 3, 4, 0, 0, 9, 0]
    for position, source in enumerate(most_attended):
        weights[position, source] = 1.0
    # year 0-3: 6,7,8 in [6,10) yes, 1 no -> 3; month 5,6: 3,4 in [2,5) -> 2; day 8,9: 0 yes, 9 no -> 1
    assert metrics.alignment_accuracy(weights, spans) == pytest.approx(6 / 8)
    # positions past the end of a short hypothesis are not scored: only the year's 4 remain
    assert metrics.alignment_accuracy(weights[:4], spans) == pytest.approx(3 / 4)


@pytest.fixture(scope="module")
def model():
    return models.create_model(
        "transformer",
        rngs=nnx.Rngs(0),
        vocab_size=9,
        d_model=8,
        num_heads=2,
        d_ff=16,
        num_encoder_layers=1,
        num_decoder_layers=2,
    )


def test_attention_weights_of_every_module(model):
    batch = {"inputs": np.array([[4, 5, 6, 2, 0]]), "targets": np.array([[7, 8, 2]])}
    weights = capture_attention(model, batch)
    roles = attention_roles(model)
    assert set(roles) == set(weights)
    assert {m for m, r in roles.items() if r is AttentionRole.CROSS} == {
        "decoder_layers/0/cross_attention",
        "decoder_layers/1/cross_attention",
    }
    assert roles["encoder_layers/0/self_attention"] is AttentionRole.SOURCE_SELF
    assert roles["decoder_layers/1/self_attention"] is AttentionRole.TARGET_SELF
    assert sorted(weights) == [
        "decoder_layers/0/cross_attention",
        "decoder_layers/0/self_attention",
        "decoder_layers/1/cross_attention",
        "decoder_layers/1/self_attention",
        "encoder_layers/0/self_attention",
    ]
    assert weights["decoder_layers/1/cross_attention"].shape == (1, 2, 3, 5)
    # source padding
    assert np.all(np.asarray(weights["decoder_layers/1/cross_attention"])[..., 4] == 0)


def test_draw_example_writes_pictures_and_weights(model, tmp_path):
    batch = {"inputs": np.array([[4, 5, 6, 2]]), "targets": np.array([[7, 8, 2]])}
    roles = attention_roles(model)
    cut = pictures.example_weights(capture_attention(model, batch), roles, 0, 4, 3)
    assert cut["encoder_layers/0/self_attention"].shape == (2, 4, 4)  # [N, S, S]
    assert cut["decoder_layers/0/self_attention"].shape == (2, 3, 3)  # [N, T, T]
    assert cut["decoder_layers/0/cross_attention"].shape == (2, 3, 4)  # [N, T, S]
    source, output = ["a", "b", "c", "</s>"], ["x", "y", "</s>"]
    drawn = pictures.draw_example(tmp_path, "example_0", cut, roles, source, output)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "example_0_decoder_layers_0_cross_attention.png",
        "example_0_decoder_layers_1_cross_attention.png",
    ]
    assert all(p.ndim == 3 and p.shape[2] == 3 and p.dtype == np.uint8 for p in drawn.values())
    saved = np.load(tmp_path / "example_0.npz")
    assert saved["source_tokens"].tolist() == source and saved["output_tokens"].tolist() == output
    np.testing.assert_array_equal(saved["decoder_layers_1_cross_attention"], cut["decoder_layers/1/cross_attention"])
    pictures.draw_example(tmp_path / "all", "e", cut, roles, source, output, self_attention=True)
    assert len(list((tmp_path / "all").glob("*.png"))) == 5
