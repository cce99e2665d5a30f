"""Vocabularies: character, word and SentencePiece tokenizers with fixed special ids.

Ids 0-3 are the same for every tokenizer: pad 0, bos 1, eos 2, unk 3. A
tokenizer is trained on the train split (up to `max_corpus_chars` characters),
saved in the workdir, and loaded from there on resume, eval and predict, so a
run always decodes with the vocabulary it was trained with. A saved tokenizer
file that is missing, unreadable or changed since it was saved (its SHA-256 is
kept beside it) stops the run with a DataError naming it: a new tokenizer would
not fit the run's checkpoints, so none is trained in its place.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import sentencepiece as spm

from utils import progress
from utils.errors import ConfigError, DataError
from utils.files import sha256, write_whole

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_PIECES = ("<pad>", "<s>", "</s>", "<unk>")


class Tokenizer(Protocol):
    vocab_size: int

    # int32 ids, no bos/eos
    def encode(self, text: str) -> np.ndarray: ...
    # stops at eos, skips pad and bos
    def decode(self, ids: Iterable[int]) -> str: ...
    # one readable string per id, for pictures
    def pieces(self, ids: Iterable[int]) -> list[str]: ...
    def save(self, path: Path) -> None: ...


def _until_eos(ids: Iterable[int]) -> list[int]:
    """The ids before the first eos, without pad and bos."""
    kept = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i not in (PAD_ID, BOS_ID):
            kept.append(i)
    return kept


def _limited(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """The texts in order until `max_chars` characters have been given."""
    total = 0
    for text in texts:
        if total >= max_chars:
            return
        total += len(text)
        yield text


class CharTokenizer:
    """One id per character seen in training (sorted), after the four special ids."""

    kind = "char"

    def __init__(self, chars: str):
        self.chars = chars
        self._ids = {c: i + len(SPECIAL_PIECES) for i, c in enumerate(chars)}
        self.vocab_size = len(SPECIAL_PIECES) + len(chars)

    @classmethod
    def train(cls, texts: Iterable[str], max_corpus_chars: int) -> CharTokenizer:
        return cls("".join(sorted(set("".join(_limited(texts, max_corpus_chars))))))

    def encode(self, text: str) -> np.ndarray:
        return np.array([self._ids.get(c, UNK_ID) for c in text], np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.pieces(_until_eos(ids)))

    def pieces(self, ids: Iterable[int]) -> list[str]:
        n = len(SPECIAL_PIECES)
        return [
            self.chars[i - n] if n <= i < self.vocab_size else SPECIAL_PIECES[min(i, UNK_ID)] for i in map(int, ids)
        ]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"kind": self.kind, "chars": self.chars}, ensure_ascii=False))

    @classmethod
    def load(cls, path: Path) -> CharTokenizer:
        return cls(json.loads(path.read_text())["chars"])


class WordTokenizer:
    """One id per word (split on whitespace) among the `vocab_size - 4` most frequent in training
    (ties in first-seen order), after the four special ids; other words are unk. Captions are
    read word by word, as Xu et al.'s vocabulary does, so that a word's attention is one step's."""

    kind = "word"

    def __init__(self, words: list[str]):
        self.words = list(words)
        self._ids = {w: i + len(SPECIAL_PIECES) for i, w in enumerate(self.words)}
        self.vocab_size = len(SPECIAL_PIECES) + len(self.words)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, max_corpus_chars: int) -> WordTokenizer:
        counts = collections.Counter(word for text in _limited(texts, max_corpus_chars) for word in text.split())
        return cls([word for word, _ in counts.most_common(max(vocab_size - len(SPECIAL_PIECES), 0))])

    def encode(self, text: str) -> np.ndarray:
        return np.array([self._ids.get(w, UNK_ID) for w in text.split()], np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.pieces(_until_eos(ids)))

    def pieces(self, ids: Iterable[int]) -> list[str]:
        n = len(SPECIAL_PIECES)
        return [
            self.words[i - n] if n <= i < self.vocab_size else SPECIAL_PIECES[min(i, UNK_ID)] for i in map(int, ids)
        ]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"kind": self.kind, "words": self.words}, ensure_ascii=False))

    @classmethod
    def load(cls, path: Path) -> WordTokenizer:
        return cls(json.loads(path.read_text())["words"])


class SentencePieceTokenizer:
    """A SentencePiece model (unigram or BPE) with the fixed special ids."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self.processor = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self.processor.get_piece_size()

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, model_type: str, max_corpus_chars: int
    ) -> SentencePieceTokenizer:
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=_limited(texts, max_corpus_chars),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            character_coverage=1.0,
            # a small corpus gets a smaller vocabulary instead of an error
            hard_vocab_limit=False,
            num_threads=2,
            minloglevel=2,
        )
        return cls(model.getvalue())

    def encode(self, text: str) -> np.ndarray:
        return np.array(self.processor.encode(text), np.int32)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, as `encode` gives them: one call for all (about twice as fast), on one
        thread (the processes tokenizing in parallel each take a core)."""
        return self.processor.encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode(_until_eos(ids))

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self.processor.id_to_piece(int(i)) for i in ids]

    def save(self, path: Path) -> None:
        path.write_bytes(self.model_proto)

    # to the processes that tokenize in parallel: the model, not the processor
    def __reduce__(self):
        return type(self), (self.model_proto,)

    @classmethod
    def load(cls, path: Path) -> SentencePieceTokenizer:
        return cls(path.read_bytes())


KINDS = {"char": CharTokenizer, "word": WordTokenizer, "sentencepiece": SentencePieceTokenizer}


@dataclasses.dataclass(frozen=True)
class Tokenizers:
    source: Tokenizer
    target: Tokenizer

    @functools.cached_property
    def digest(self) -> str:
        """Names the vocabularies by their saved files: the same digest, the same ids for every text."""
        hashed = hashlib.sha256()
        with tempfile.TemporaryDirectory() as folder:
            for name, tokenizer in (("source", self.source), ("target", self.target)):
                tokenizer.save(Path(folder) / name)
                hashed.update(type(tokenizer).__name__.encode() + (Path(folder) / name).read_bytes())
        return hashed.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """`config.tokenizer`. Its fields, as a dict, are what a saved vocabulary records."""

    kind: str
    vocab_size: int
    model_type: str
    shared: bool
    max_corpus_chars: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"tokenizer.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.model_type not in ("unigram", "bpe"):
            raise ConfigError(f"tokenizer.model_type must be 'unigram' or 'bpe', got {self.model_type!r}")
        for name in ("vocab_size", "max_corpus_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tokenizer.{name} must be positive, got {getattr(self, name)}")


def _train(settings: TokenizerSettings, texts: Iterable[str]) -> Tokenizer:
    if settings.kind == "char":
        return CharTokenizer.train(texts, settings.max_corpus_chars)
    if settings.kind == "word":
        return WordTokenizer.train(texts, settings.vocab_size, settings.max_corpus_chars)
    return SentencePieceTokenizer.train(texts, settings.vocab_size, settings.model_type, settings.max_corpus_chars)


def sample(pairs: Iterable[tuple[str, str]], max_chars: int, *, shared: bool) -> list[tuple[str, str]]:
    """The first pairs, read one at a time, until every vocabulary has the `max_chars` characters it
    learns from (`_limited`): a shared one over sources and targets together, else each side's own.
    A corpus of any size costs memory for the sample alone."""
    kept, chars = [], np.zeros(2, np.int64)
    with progress.phase("reading the vocabulary's sample", unit="pairs") as shown:
        for source, target in pairs:
            if (chars.sum() >= max_chars) if shared else (chars >= max_chars).all():
                break
            kept.append((source, target))
            chars += (len(source), len(target))
            shown.advance()
    return kept


def _trained(settings: TokenizerSettings, pairs: list[tuple[str, str]]) -> list[Tokenizer]:
    """The shared tokenizer, or the source's and the target's, trained on `pairs`."""
    if settings.shared:
        return [_train(settings, (text for pair in pairs for text in pair))]
    return [_train(settings, (s for s, _ in pairs)), _train(settings, (t for _, t in pairs))]


def restore_fix(directory: Path) -> str:
    """What to do about a damaged saved tokenizer."""
    return (
        f"restore it from a copy of the run folder: a new tokenizer would not fit the run's checkpoints "
        f"(a run without checkpoints may delete {directory} to train a new one)"
    )


def read_json(path: Path):
    """A JSON file of the tokenizer directory; a DataError naming it if it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        # ValueError: not UTF-8, not JSON
        raise DataError(f"tokenizer file {path} is unreadable ({error}); {restore_fix(path.parent)}") from error


def load_saved(kind: str, path: Path, checksum: str | None) -> Tokenizer:
    """The tokenizer saved at `path`, checked against its `checksum` (None: a run saved before
    checksums were kept); a DataError naming the file if it is missing, changed or unreadable."""
    if checksum is not None and path.is_file() and sha256(path) != checksum:
        raise DataError(
            f"tokenizer file {path} changed since it was saved (its SHA-256 is not the one in "
            f"{path.parent / 'checksums.json'}); {restore_fix(path.parent)}"
        )
    try:
        tokenizer = KINDS[kind].load(path)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        # RuntimeError: SentencePiece's
        raise DataError(f"tokenizer file {path} is unreadable ({error}); {restore_fix(path.parent)}") from error
    # SentencePiece loads an empty file as an empty model
    if tokenizer.vocab_size < len(SPECIAL_PIECES):
        raise DataError(f"tokenizer file {path} holds no vocabulary; {restore_fix(path.parent)}")
    return tokenizer


def load_or_train(
    directory: Path,
    settings: TokenizerSettings,
    train_pairs: Iterable[tuple[str, str]] | None = None,
    *,
    shelf: Path | None = None,
) -> Tokenizers:
    """The tokenizers saved in `directory`, or new ones trained on `train_pairs` and saved there
    (with `checksums.json`, the SHA-256 of each file, that later loads check).

    `shelf` (a folder beside the built data the pairs come from) keeps a copy of what was trained
    there, by settings: a run in a new workdir with the same settings copies it instead of training.

    Raises:
      DataError: the saved tokenizers were made with other settings than `settings`, a saved
        file is missing, unreadable or changed, or there are none and no text to train them on.
    """
    directory = Path(directory)
    settings_file, checksums_file = directory / "settings.json", directory / "checksums.json"
    suffix = ".model" if settings.kind == "sentencepiece" else ".json"
    files = [f"{name}{suffix}" for name in (("shared",) if settings.shared else ("source", "target"))]
    if settings_file.exists():
        saved = read_json(settings_file)
        if saved != dataclasses.asdict(settings):
            raise DataError(
                f"the tokenizer in {directory} was trained with {saved}, but the config asks for "
                f"{dataclasses.asdict(settings)}; use a fresh workdir or the original tokenizer settings"
            )
        checksums = read_json(checksums_file) if checksums_file.exists() else {}
        loaded = [load_saved(settings.kind, directory / file, checksums.get(file)) for file in files]
    else:
        shelved = (
            shelf / hashlib.sha256(json.dumps(dataclasses.asdict(settings), sort_keys=True).encode()).hexdigest()[:16]
            if shelf
            else None
        )
        if shelved is not None and (shelved / "settings.json").exists():
            shutil.copytree(shelved, directory, dirs_exist_ok=True, ignore=shutil.ignore_patterns("settings.json"))
            # last: marks the copy complete
            shutil.copy(shelved / "settings.json", directory)
            return load_or_train(directory, settings)
        if train_pairs is None:
            raise DataError(f"no tokenizer in {directory} and no training text to make one")
        pairs = sample(train_pairs, settings.max_corpus_chars, shared=settings.shared)
        with progress.phase(f"training the {settings.kind} vocabulary", unit="pairs") as shown:
            # the trainers report nothing along the way: a start and an end line
            loaded = _trained(settings, pairs)
            shown.advance(len(pairs))
        directory.mkdir(parents=True, exist_ok=True)
        for file, tokenizer in zip(files, loaded):
            tokenizer.save(directory / file)
        checksums_file.write_text(json.dumps({file: sha256(directory / file) for file in files}))
        # last: marks the save complete
        settings_file.write_text(json.dumps(dataclasses.asdict(settings)))
        if shelved is not None:
            try:
                write_whole(shelved, lambda temporary: shutil.copytree(directory, temporary, dirs_exist_ok=True))
            except OSError:
                # another process shelved the same settings first, or the data is read-only
                pass
    return Tokenizers(loaded[0], loaded[-1])
