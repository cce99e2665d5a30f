"""The `dates` task (the embedded default): dates as people write them -> ISO 8601.

Sources use the CLDR date patterns of several languages (full, long and medium
forms, through babel: "vendredi 3 avril 2020", "3. April 2020", "3 de abril de
2020"), English ordinals ("the 3rd of April, 2020"), and numeric forms in
which the separator tells the field order: `/` is month/day/year, `.` is
day.month.year, `-` is day-month-year, and a four-digit year first is
year-month-day. Two-digit years stand for 1950-2049. The target is `YYYY-MM-DD`.

Each example records the ground-truth alignment `[3, 2]`: the `[start, end)`
character span of the source that produced the year, the month and the day
(target characters 0-3, 5-6 and 8-9: `TARGET_SPANS`); `alignment_spans` pairs
them up for the alignment metric. No source string appears with two
different targets, and dev/test sources never appear in train.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools

import numpy as np
import tensorflow_datasets as tfds
from babel import Locale
from babel.dates import format_date, tokenize_pattern

from tasks.task_builder import TaskConfig, TextPairBuilder
from utils.errors import ConfigError

LANGUAGES = ("en", "fr", "de", "es", "it", "pt", "nl")
NUMERIC_PATTERNS = (
    # year first
    "y-MM-dd",
    "y/MM/dd",
    "yMMdd",
    # day.month.year
    "dd.MM.y",
    "d.M.y",
    "dd.MM.yy",
    # day-month-year
    "dd-MM-y",
    "d-M-y",
    # month/day/year
    "MM/dd/y",
    "M/d/y",
    "MM/dd/yy",
)
ORDINAL_PATTERNS = ("MMMM {o}, y", "{o} MMMM y", "'the' {o} 'of' MMMM, y", "MMM {o} y", "EEEE, MMMM {o}, y")
# rows of the alignment array
FIELDS = ("year", "month", "day")
# where each field sits in YYYY-MM-DD
TARGET_SPANS = ((0, 4), (5, 7), (8, 10))

_FIELD_OF_CHAR = {"y": "year", "M": "month", "L": "month", "d": "day", "o": "day"}
_FULL_RANGE = (datetime.date(1900, 1, 1), datetime.date(2099, 12, 31))
_TWO_DIGIT_RANGE = (datetime.date(1950, 1, 1), datetime.date(2049, 12, 31))


@dataclasses.dataclass(eq=False)
class DatesConfig(TaskConfig):
    seed: int = 0
    train_size: int = 20_000
    dev_size: int = 1_000
    test_size: int = 1_000
    languages: tuple[str, ...] = LANGUAGES


def alignment_spans(record) -> np.ndarray:
    """`[3, 4]` int32: per field, the target span and the source span it is read from
    (`tasks.Task.alignment`). The dashes of the target have no source and are not scored."""
    return np.concatenate([np.array(TARGET_SPANS, np.int32), np.asarray(record["alignment"], np.int32)], axis=1)


def ordinal(day: int) -> str:
    """English ordinal: 1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st, 22nd, 23rd."""
    suffix = "th" if 10 <= day % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


@functools.cache
def tokens(pattern: str) -> tuple:
    """Babel's pattern tokens, with `{o}` (an English ordinal day) as the field `('o', 1)`."""
    parts = pattern.split("{o}")
    result = []
    for i, part in enumerate(parts):
        if i:
            result.append(("field", ("o", 1)))
        result.extend(tokenize_pattern(part))
    return tuple(result)


def render(date: datetime.date, pattern: str, locale: str) -> tuple[str, np.ndarray]:
    """Formats `date`; returns the text and the `[3, 2]` spans of year, month, day in it."""
    pieces, spans = [], np.zeros((3, 2), np.int32)
    position = 0
    for kind, value in tokens(pattern):
        if kind == "chars":
            piece = value
        else:
            char, count = value
            piece = ordinal(date.day) if char == "o" else format_date(date, char * count, locale=locale)
            if char in _FIELD_OF_CHAR:
                spans[FIELDS.index(_FIELD_OF_CHAR[char])] = (position, position + len(piece))
        pieces.append(piece)
        position += len(piece)
    return "".join(pieces), spans


@functools.cache
def formats(languages: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Every (pattern, locale) the task draws from."""
    result = []
    for language in languages:
        patterns = Locale.parse(language).date_formats
        result += [(patterns[width].pattern, language) for width in ("full", "long", "medium")]
    result += [(pattern, "en") for pattern in NUMERIC_PATTERNS]
    if "en" in languages:
        result += [(pattern, "en") for pattern in ORDINAL_PATTERNS]
    return tuple(result)


def draw_example(rng: np.random.Generator, languages: tuple[str, ...]) -> dict:
    """One random example: a date in a random format and letter case."""
    options = formats(languages)
    pattern, locale = options[rng.integers(len(options))]
    low, high = _TWO_DIGIT_RANGE if "yy" in pattern.replace("yyyy", "") else _FULL_RANGE
    date = low + datetime.timedelta(days=int(rng.integers((high - low).days + 1)))
    source, spans = render(date, pattern, locale)
    case = rng.choice(["as is", "upper", "lower"], p=[0.7, 0.15, 0.15])
    cased = {"as is": source, "upper": source.upper(), "lower": source.lower()}[case]
    # keep the spans valid (e.g. no 'ß' -> 'SS')
    if len(cased) == len(source):
        source = cased
    return {"source": source, "target": date.isoformat(), "alignment": spans, "format": f"{locale}:{pattern}"}


def generate(config: DatesConfig) -> dict[str, list[dict]]:
    """All splits; test and dev are drawn first so that train can avoid their sources."""
    rng = np.random.default_rng(config.seed)
    languages = tuple(config.languages)
    unknown = sorted(set(languages) - set(LANGUAGES))
    if unknown:
        raise ConfigError(f"task.languages: unsupported {', '.join(unknown)}; supported: {', '.join(LANGUAGES)}")
    # every source drawn so far -> its target
    target_of: dict[str, str] = {}
    # dev and test sources
    held_out: set[str] = set()
    splits = {}
    for split, size in (("test", config.test_size), ("dev", config.dev_size), ("train", config.train_size)):
        examples, seen = [], set()
        while len(examples) < size:
            example = draw_example(rng, languages)
            source = example["source"]
            if target_of.setdefault(source, example["target"]) != example["target"]:
                # a string that could mean two dates: never used
                continue
            if source in held_out or (split != "train" and source in seen):
                continue
            examples.append(example)
            seen.add(source)
        splits[split] = examples
        if split != "train":
            held_out |= seen
    return splits


class Dates(TextPairBuilder):
    """Dates in many formats and languages -> ISO 8601, with alignment spans."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIG_CLASS = DatesConfig
    EXTRA_FEATURES = {
        "alignment": tfds.features.Tensor(shape=(3, 2), dtype=np.int32),
        "format": tfds.features.Text(),
    }

    def _split_examples(self):
        return generate(self.builder_config)
