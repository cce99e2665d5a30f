"""`digit_strips`: images of 1 to 5 real handwritten digits in a row, captioned left to right.

Each example is a grey canvas (`canvas_height x canvas_width`, uint8) holding
1 to `max_digits` of the UCI optical-digits scans (`data/digits/`, 8x8 each,
0..16), each drawn at an integer scale from 1 to `max_scale` (nearest-neighbour,
so never below its scanned size) at a random place, left to right without
overlap, with light Gaussian noise. The caption names the digits from left to
right ("three one four"); every digit's box `(x0, y0, x1, y1)` (pixels, end
exclusive) is recorded, in caption order, padded with -1 rows.

The 1,797 scans are split three ways (`scan_fractions`) before any strip is
composed, so dev and test strips are made of scans never seen in training
(the data has no writer ids: unseen scans, not unseen writers).
"""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from tasks.task_builder import SPLITS, TaskConfig, TextPairBuilder
from utils.errors import ConfigError, DataError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SCANS = PROJECT_ROOT / "data" / "digits" / "optdigits_test.csv.gz"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SCAN_SIZE = 8


@dataclasses.dataclass(eq=False)
class DigitStripsConfig(TaskConfig):
    canvas_height: int = 24
    canvas_width: int = 96
    min_digits: int = 1
    max_digits: int = 5
    # digits are drawn 8x8 times an integer scale in [1, max_scale]
    max_scale: int = 2
    # standard deviation of the added noise, as a share of the brightest pixel
    noise: float = 0.05
    # scans kept for train, dev and test
    scan_fractions: tuple[float, ...] = (0.6, 0.2, 0.2)
    train_size: int = 20_000
    dev_size: int = 1_000
    test_size: int = 1_000
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ConfigError(f"task needs 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if self.max_scale < 1:
            raise ConfigError(f"task.max_scale must be at least 1, got {self.max_scale}")
        tallest = SCAN_SIZE * self.max_scale
        if self.canvas_height < tallest or self.canvas_width < self.max_digits * (tallest + 1):
            raise ConfigError(
                f"task canvas {self.canvas_height}x{self.canvas_width} cannot hold {self.max_digits} digits of up to "
                f"{tallest}x{tallest} pixels side by side; enlarge task.canvas_height / task.canvas_width"
            )
        if len(self.scan_fractions) != 3 or min(self.scan_fractions) <= 0 or abs(sum(self.scan_fractions) - 1) > 1e-6:
            raise ConfigError(
                f"task.scan_fractions must be three positive shares summing to 1, got {self.scan_fractions}"
            )


def load_scans(path: Path = SCANS) -> tuple[np.ndarray, np.ndarray]:
    """`(images [N, 8, 8] uint8 in 0..16, digits [N])` of the shipped scans."""
    try:
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    except (OSError, ValueError, EOFError) as error:
        raise DataError(
            f"digit_strips: cannot read the digit scans {path} ({error}); restore it from the repository"
        ) from error
    if table.ndim != 2 or table.shape[1] != SCAN_SIZE * SCAN_SIZE + 1:
        raise DataError(f"digit_strips: {path} should hold rows of 64 pixels and a label, got shape {table.shape}")
    return table[:, :-1].reshape(-1, SCAN_SIZE, SCAN_SIZE).astype(np.uint8), table[:, -1]


def split_scans(count: int, fractions, seed: int) -> dict[str, np.ndarray]:
    """Disjoint scan indices per split, shuffled by `seed`."""
    order = np.random.default_rng([seed, 1797]).permutation(count)
    ends = np.cumsum([round(f * count) for f in fractions[:-1]])
    return dict(zip(SPLITS, np.split(order, ends)))


def compose(
    rng: np.random.Generator, images: np.ndarray, labels: np.ndarray, pool: np.ndarray, config: DigitStripsConfig
) -> dict:
    """One strip: `{'image' [H, W] uint8, 'caption', 'boxes' [max_digits, 4] and 'scans' [max_digits]
    (the scans' indices), both int32 and -1 padded}`."""
    count = int(rng.integers(config.min_digits, config.max_digits + 1))
    chosen = rng.choice(pool, size=count)
    scales = rng.integers(1, config.max_scale + 1, size=count)
    widths = SCAN_SIZE * scales
    # free columns, shared out as gaps before each digit
    slack = config.canvas_width - int(widths.sum())
    gaps = np.diff(np.sort(rng.integers(0, slack + 1, size=count)), prepend=0)
    canvas = np.zeros((config.canvas_height, config.canvas_width), np.float64)
    boxes = np.full((config.max_digits, 4), -1, np.int32)
    scans = np.full(config.max_digits, -1, np.int32)
    x = 0
    for number, (index, scale, gap) in enumerate(zip(chosen, scales, gaps)):
        x += int(gap)
        size = SCAN_SIZE * int(scale)
        y = int(rng.integers(0, config.canvas_height - size + 1))
        canvas[y : y + size, x : x + size] = np.kron(images[index], np.ones((scale, scale))) / 16.0
        boxes[number], scans[number] = (x, y, x + size, y + size), index
        x += size
    canvas += rng.normal(scale=config.noise, size=canvas.shape)
    image = np.clip(np.round(canvas * 255), 0, 255).astype(np.uint8)
    return {"image": image, "caption": " ".join(WORDS[labels[i]] for i in chosen), "boxes": boxes, "scans": scans}


def generate(config: DigitStripsConfig) -> dict[str, list[dict]]:
    images, labels = load_scans()
    pools = split_scans(len(images), config.scan_fractions, config.seed)
    rng = np.random.default_rng(config.seed)
    return {
        split: [compose(rng, images, labels, pools[split], config) for _ in range(getattr(config, f"{split}_size"))]
        for split in SPLITS
    }


def word_boxes(record) -> np.ndarray:
    """The boxes of the caption's digits, left to right `[max_digits, 4]` (-1 rows: no digit)."""
    return np.asarray(record["boxes"], np.int32)


class DigitStrips(TextPairBuilder):
    """Strips of handwritten digits captioned left to right, with each digit's box."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIG_CLASS = DigitStripsConfig

    def _features(self):
        config = self.builder_config
        return {
            "image": tfds.features.Tensor(shape=(config.canvas_height, config.canvas_width), dtype=np.uint8),
            "caption": tfds.features.Text(),
            "boxes": tfds.features.Tensor(shape=(config.max_digits, 4), dtype=np.int32),
            "scans": tfds.features.Tensor(shape=(config.max_digits,), dtype=np.int32),
        }

    def _split_examples(self):
        return generate(self.builder_config)
