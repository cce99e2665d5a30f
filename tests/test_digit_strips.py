"""digit_strips: real scans composed into captioned strips, boxes that hold their digits, unseen test scans."""

import numpy as np
import pytest

from tasks import digit_strips, task_builder
from tasks.digit_strips import WORDS, DigitStrips, DigitStripsConfig
from utils.errors import ConfigError


def test_the_scans_and_their_three_way_split():
    images, labels = digit_strips.load_scans()
    assert images.shape == (1797, 8, 8) and images.max() == 16 and sorted(set(labels)) == list(range(10))
    pools = digit_strips.split_scans(len(images), (0.6, 0.2, 0.2), seed=0)
    # disjoint and covering
    assert sorted(np.concatenate(list(pools.values()))) == list(range(1797))
    assert [len(pools[s]) for s in ("train", "dev", "test")] == [1078, 359, 360]


def test_a_strip_holds_its_digits_in_their_boxes_left_to_right():
    config = DigitStripsConfig.create(noise=0.0, train_size=1, dev_size=1, test_size=1)
    images, labels = digit_strips.load_scans()
    rng = np.random.default_rng(3)
    for _ in range(50):
        strip = digit_strips.compose(rng, images, labels, np.arange(1797), config)
        used = strip["scans"][strip["scans"] >= 0]
        boxes = strip["boxes"][: len(used)]
        assert strip["caption"].split() == [WORDS[labels[i]] for i in used]
        assert np.all(strip["boxes"][len(used) :] == -1) and 1 <= len(used) <= 5
        assert (
            np.all(boxes[:, 2] <= config.canvas_width)
            and np.all(boxes[:, 3] <= config.canvas_height)
            and np.all(boxes >= 0)
        )
        # left to right, no overlap
        assert np.all(boxes[1:, 0] >= boxes[:-1, 2])
        canvas = np.zeros_like(strip["image"], dtype=np.float64)
        for (x0, y0, x1, y1), index in zip(boxes, used):
            scale = (x1 - x0) // 8
            # drawn at scale 1 or larger, square
            assert scale in (1, 2) and y1 - y0 == x1 - x0
            canvas[y0:y1, x0:x1] = np.kron(images[index], np.ones((scale, scale))) / 16 * 255
        # no noise: exactly the scans
        np.testing.assert_allclose(strip["image"], np.round(canvas), atol=0.5)


def test_built_splits_use_disjoint_scans(tmp_path):
    builder = DigitStrips(
        config=DigitStripsConfig.create(train_size=40, dev_size=10, test_size=10), data_dir=str(tmp_path)
    )
    builder.download_and_prepare()
    splits = builder.as_data_source()
    seen = {
        split: {int(i) for record in splits[split] for i in record["scans"] if i >= 0}
        for split in ("train", "dev", "test")
    }
    assert not (seen["test"] & seen["train"]) and not (seen["dev"] & seen["train"]) and not (seen["dev"] & seen["test"])
    record = splits["test"][0]
    assert record["image"].shape == (24, 96) and record["image"].dtype == np.uint8
    assert task_builder.text(record["caption"]).split()[0] in WORDS
    # light noise on the canvas
    assert record["image"].std() > 0


def test_a_canvas_too_small_is_named():
    with pytest.raises(ConfigError, match="canvas 12x96 cannot hold 5 digits"):
        DigitStripsConfig.create(canvas_height=12)
