"""Synthetic sequence tasks: copy, reverse, sort, addition.

Sequences are strings over an alphabet of single-character symbols (digits,
then lower- and upper-case letters), so the character tokenizer gives one token
per symbol and "length" means tokens. Source lengths are uniform in
`[min_length, max_length]` (the length experiment uses 5 to 100).

- copy:     `abca` -> `abca`
- reverse:  `abca` -> `acba`
- sort:     `cab`  -> `abc` (by alphabet order)
- addition: `123+4567` -> `4690` (operand lengths drawn so the source length is in range)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from tasks.task_builder import SPLITS, TaskConfig, TextPairBuilder
from utils.errors import ConfigError

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
KINDS = ("copy", "reverse", "sort", "addition")


@dataclasses.dataclass(eq=False)
class SyntheticConfig(TaskConfig):
    kind: str = "copy"
    min_length: int = 5
    max_length: int = 100
    # symbols, at most len(ALPHABET); addition always uses the 10 digits
    vocab_size: int = 20
    train_size: int = 20_000
    dev_size: int = 1_000
    test_size: int = 1_000
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"synthetic task kind {self.kind!r}; valid: {', '.join(KINDS)}")
        if not 1 <= self.vocab_size <= len(ALPHABET):
            raise ConfigError(f"task.vocab_size must be in [1, {len(ALPHABET)}], got {self.vocab_size}")
        # "a+b" needs three characters
        lowest = 3 if self.kind == "addition" else 1
        if not lowest <= self.min_length <= self.max_length:
            raise ConfigError(
                f"task lengths need {lowest} <= min_length <= max_length, got {self.min_length}, {self.max_length}"
            )


def draw_pair(kind: str, length: int, vocab_size: int, rng: np.random.Generator) -> tuple[str, str]:
    """One (source, target) of `length` source symbols."""
    if kind == "addition":
        # at least one digit on each side of '+'
        left_digits = int(rng.integers(1, length - 1))
        right_digits = length - 1 - left_digits
        left, right = (_random_number(n, rng) for n in (left_digits, right_digits))
        return f"{left}+{right}", str(int(left) + int(right))
    symbols = "".join(ALPHABET[i] for i in rng.integers(vocab_size, size=length))
    target = {"copy": symbols, "reverse": symbols[::-1], "sort": "".join(sorted(symbols, key=ALPHABET.index))}
    return symbols, target[kind]


def _random_number(digits: int, rng: np.random.Generator) -> str:
    """A decimal number of exactly `digits` digits (no leading zero unless it is 0)."""
    first = str(rng.integers(1, 10)) if digits > 1 else str(rng.integers(10))
    return first + "".join(str(d) for d in rng.integers(10, size=digits - 1))


def generate(config: SyntheticConfig) -> dict[str, list[dict]]:
    rng = np.random.default_rng(config.seed)
    splits = {}
    for split in SPLITS:
        size = getattr(config, f"{split}_size")
        lengths = rng.integers(config.min_length, config.max_length + 1, size=size)
        pairs = [draw_pair(config.kind, int(n), config.vocab_size, rng) for n in lengths]
        splits[split] = [{"source": s, "target": t} for s, t in pairs]
    return splits


class Synthetic(TextPairBuilder):
    """Copy, reverse, sort and addition over symbol strings of configurable length."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIG_CLASS = SyntheticConfig

    def _split_examples(self):
        return generate(self.builder_config)
