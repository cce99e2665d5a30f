"""Damaged data stops with one DataError naming the file and the fix, never a library's traceback:
built shards (truncated, overwritten, deleted), a run's saved tokenizer, a corpus file deleted
after the build; and fuzzed corpus files, whose junk lines are skipped and counted, never fatal."""

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import input_pipeline as ip
import tasks
from configs import base
from run_setup.input_kinds import KINDS
from run_setup.settings import TokenizerSettings, parse
from tasks import image_captions, parallel_text, task_builder
from tasks import vocabularies as tk
from utils.errors import DataError

TEXT = KINDS["text"]

PAIRS = [(f"source sentence {i}", f"target sentence {i}") for i in range(40)]
# ArrayRecord pads a shard to 64 KiB blocks and keeps its footer at the start of the last one
BLOCK = 1 << 16


def write_tsv(path: Path, pairs) -> str:
    path.write_text("".join(f"{source}\t{target}\n" for source, target in pairs))
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """The parameters of a small `parallel_text` task over TSVs of a module folder."""
    folder = tmp_path_factory.mktemp("corpus")
    return {
        split: write_tsv(folder / f"{split}.tsv", PAIRS[:n]) for split, n in (("train", 40), ("dev", 4), ("test", 4))
    }


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory) -> Path:
    """A data_dir holding the task built once; tests damage copies of it."""
    data_dir = tmp_path_factory.mktemp("built")
    tasks.load_task("parallel_text", str(data_dir), **corpus)
    return data_dir


@pytest.fixture
def copy_of_built(built, tmp_path) -> tuple[str, Path]:
    """`(data_dir, the train shard)` of a fresh copy of the built task."""
    data_dir = shutil.copytree(built, tmp_path / "data")
    (shard,) = data_dir.glob("parallel_text/*/*/parallel_text-train.array_record-*")
    return str(data_dir), shard


def escaped(path) -> str:
    """`path` as a regular expression matching itself."""
    return re.escape(str(path))


def overwrite(path: Path, start: int, length: int) -> None:
    """Replaces `length` bytes from `start` with bytes that differ from each of them."""
    data = bytearray(path.read_bytes())
    data[start : start + length] = bytes(b ^ 0x5A for b in data[start : start + length])
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------ built shards

DAMAGES = {
    # reads back as empty records
    "truncated to one block": lambda shard: shard.write_bytes(shard.read_bytes()[:BLOCK]),
    "truncated inside the records": lambda shard: shard.write_bytes(shard.read_bytes()[:1000]),
    "appended to": lambda shard: shard.write_bytes(shard.read_bytes() + b"junk"),
    "footer overwritten": lambda shard: overwrite(shard, shard.stat().st_size - BLOCK + 8, 16),
    "deleted": lambda shard: shard.unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_shard_stops_the_load_naming_it_and_the_fix(copy_of_built, corpus, damage):
    data_dir, shard = copy_of_built
    DAMAGES[damage](shard)
    message = f"corrupt built data: {escaped(shard)} .*delete the folder {escaped(shard.parent)} and run again"
    with pytest.raises(DataError, match=message):
        tasks.load_task("parallel_text", data_dir, **corpus)
    # the fix: the next load rebuilds the data
    shutil.rmtree(shard.parent)
    task = tasks.load_task("parallel_text", data_dir, **corpus)
    assert [task.pair(r) for r in task.splits["train"]] == PAIRS


def test_a_passed_shard_check_is_remembered_until_a_shard_changes(copy_of_built, corpus, monkeypatch):
    data_dir, shard = copy_of_built
    # checks every shard's footer and remembers that they passed
    tasks.load_task("parallel_text", data_dir, **corpus)
    footers_read = []
    read_footer = task_builder.records_in
    monkeypatch.setattr(task_builder, "records_in", lambda path: footers_read.append(path) or read_footer(path))
    tasks.load_task("parallel_text", data_dir, **corpus)
    assert footers_read == []
    # the same size, a new modification time: checked again
    DAMAGES["footer overwritten"](shard)
    with pytest.raises(DataError, match=f"corrupt built data: {escaped(shard)} "):
        tasks.load_task("parallel_text", data_dir, **corpus)
    assert shard in footers_read


def test_shard_without_recorded_sizes_still_has_its_records_checked(copy_of_built, corpus):
    """Data built before shard sizes were recorded: a truncated shard has no footer holding its records."""
    data_dir, shard = copy_of_built
    (shard.parent / "metadata.json").write_text('{"build_report": {}}')
    DAMAGES["truncated to one block"](shard)
    with pytest.raises(DataError, match=f"{escaped(shard)} is not a readable array_record file"):
        tasks.load_task("parallel_text", data_dir, **corpus)


def test_overwritten_records_stop_the_pipeline_before_training_naming_the_shard(copy_of_built, corpus):
    data_dir, shard = copy_of_built
    # inside the records (40 of about 100 bytes each); the footer is intact
    overwrite(shard, 1500, 20)
    # size and footer are right: loads
    task = tasks.load_task("parallel_text", data_dir, **corpus)
    chars = tk.CharTokenizer.train((text for pair in PAIRS for text in pair), 10**6)
    settings = dataclasses.replace(parse(base.get_config()).data, batch_size=4, num_threads=1)
    message = f"corrupt built data: record [0-9]+ in {escaped(shard)} cannot be read .*hash mismatch.*delete the folder"
    with pytest.raises(DataError, match=message):
        # reads every record before the first batch
        ip.train_dataset(task, tk.Tokenizers(chars, chars), settings, TEXT)


def test_overwritten_padding_is_not_detected_and_harmless(copy_of_built, corpus):
    data_dir, shard = copy_of_built
    start = shard.stat().st_size - BLOCK - 100
    # zeros between the last record and the footer's block
    assert not any(shard.read_bytes()[start : start + 50])
    overwrite(shard, start, 50)
    task = tasks.load_task("parallel_text", data_dir, **corpus)
    assert [task.pair(r) for r in task.splits["train"]] == PAIRS


def test_corrupt_dataset_info_is_named(copy_of_built, corpus):
    data_dir, shard = copy_of_built
    info = shard.parent / "dataset_info.json"
    info.write_text(info.read_text()[:40])
    with pytest.raises(
        DataError, match=f"corrupt built data: {escaped(info)} .*delete the folder {escaped(shard.parent)} "
    ):
        tasks.load_task("parallel_text", data_dir, **corpus)


# ------------------------------------------------------------- saved tokenizers

TOKENIZER_KINDS = {"char": ".json", "word": ".json", "sentencepiece": ".model"}


def tokenizer_settings(kind: str) -> TokenizerSettings:
    config = base.get_config()
    config.tokenizer.update(kind=kind, vocab_size=40, shared=True)
    return parse(config).tokenizer


@pytest.fixture(scope="module")
def saved_tokenizers(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer directory of each kind, trained once."""
    folders = {}
    for kind in TOKENIZER_KINDS:
        folders[kind] = tmp_path_factory.mktemp(kind)
        tk.load_or_train(folders[kind], tokenizer_settings(kind), PAIRS)
    return folders


TOKENIZER_DAMAGES = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    # may still parse: the checksum tells
    "overwritten": lambda path: overwrite(path, path.stat().st_size // 2, 1),
    "emptied": lambda path: path.write_bytes(b""),
    "deleted": lambda path: path.unlink(),
}


TOKENIZER_CASES = [
    pytest.param(
        kind, damage, checksums, id=f"{kind}-{damage}-{'checksums' if checksums else 'saved-before-checksums'}"
    )
    for kind in TOKENIZER_KINDS
    for damage in TOKENIZER_DAMAGES
    for checksums in (True, False)
    # without its checksum, a flipped byte may parse as another valid tokenizer
    if checksums or damage != "overwritten"
]


@pytest.mark.parametrize("kind,damage,checksums", TOKENIZER_CASES)
def test_damaged_tokenizer_is_named_and_not_retrained(saved_tokenizers, tmp_path, kind, damage, checksums):
    folder = Path(shutil.copytree(saved_tokenizers[kind], tmp_path / "tokenizer"))
    if not checksums:
        # as a run saved before checksums were kept
        (folder / "checksums.json").unlink()
    path = folder / f"shared{TOKENIZER_KINDS[kind]}"
    TOKENIZER_DAMAGES[damage](path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(DataError, match=f"tokenizer file {escaped(path)} .*restore it from a copy of the run folder"):
        # training text at hand, and still no new tokenizer
        tk.load_or_train(folder, tokenizer_settings(kind), PAIRS)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_intact_tokenizer_loads_and_corrupt_settings_are_named(saved_tokenizers, tmp_path):
    folder = Path(shutil.copytree(saved_tokenizers["char"], tmp_path / "tokenizer"))
    loaded = tk.load_or_train(folder, tokenizer_settings("char"))
    assert loaded.source.decode(loaded.source.encode("source 1")) == "source 1"
    (folder / "settings.json").write_text('{"kind": "ch')
    with pytest.raises(DataError, match=f"tokenizer file {escaped(folder / 'settings.json')} is unreadable"):
        tk.load_or_train(folder, tokenizer_settings("char"), PAIRS)


# ---------------------------------------------------------- corpus files moved away


def test_corpus_file_deleted_after_the_build_is_named_with_the_fix(corpus, tmp_path):
    data_dir, moved = str(tmp_path / "data"), {**corpus, "train": write_tsv(tmp_path / "train.tsv", PAIRS)}
    tasks.load_task("parallel_text", data_dir, **moved)
    Path(moved["train"]).rename(tmp_path / "elsewhere.tsv")
    message = f"task.train: file not found: {escaped(moved['train'])} .*restore it or set task.train to where it is now"
    with pytest.raises(DataError, match=message):
        tasks.load_task("parallel_text", data_dir, **moved)
    task = tasks.load_task("parallel_text", data_dir, **{**moved, "train": str(tmp_path / "elsewhere.tsv")})
    assert [task.pair(r) for r in task.splits["train"]] == PAIRS


# ------------------------------------------------------------------ corpus fuzzing

SIDE = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\t\n"), min_size=1, max_size=12)
VALID_SIDE = SIDE.filter(str.strip)
# whitespace, no tab
BLANK = st.text(st.sampled_from(" \r\x0b\x0c\u3000"), max_size=3)
JUNK = st.one_of(
    # 0xff: never UTF-8
    st.tuples(
        st.just("invalid UTF-8"),
        st.binary(max_size=12).filter(lambda b: b"\n" not in b).map(lambda b: b[:5] + b"\xff" + b[5:]),
    ),
    st.tuples(st.just("blank"), BLANK.map(str.encode)),
    st.tuples(st.just("one field"), VALID_SIDE.map(str.encode)),
    st.tuples(
        st.just("extra tabs"), st.lists(SIDE | BLANK, min_size=3, max_size=5).map(lambda f: "\t".join(f).encode())
    ),
    st.tuples(st.just("empty source"), st.tuples(BLANK, SIDE | BLANK).map(lambda f: "\t".join(f).encode())),
    st.tuples(st.just("empty target"), st.tuples(SIDE, BLANK).map(lambda f: "\t".join(f).encode())),
)
LINES = st.lists(st.one_of(st.tuples(st.just("valid"), st.tuples(VALID_SIDE, VALID_SIDE)), JUNK), max_size=25)


def expected_reason(kind: str, line: bytes, reader: str) -> str | None:
    """The skip reason of a generated line for `reader` ("parallel_text" or "image_captions"), None if kept."""
    tabs = line.count(b"\t")
    empty_side = "an empty side" if reader == "parallel_text" else "an empty caption"
    # an empty image file name is read (and unreadable)
    if kind == "empty source" and reader == "image_captions":
        return None if line.split(b"\t")[1].decode().strip() else empty_side
    return {
        "invalid UTF-8": "invalid UTF-8",
        "blank": "a blank line",
        "one field": "1 tab-separated fields instead of 2",
        "extra tabs": f"{tabs + 1} tab-separated fields instead of 2",
        "empty source": empty_side,
        "empty target": empty_side,
    }.get(kind)


def encoded(kind: str, value) -> bytes:
    return "\t".join(value).encode() if kind == "valid" else value


def corpus_bytes(lines, endings: list[bytes], last_ending: bool) -> bytes:
    """The generated lines, each ended by its `endings` (`\n` or `\r\n`), the last maybe by nothing."""
    lines = [encoded(kind, value) for kind, value in lines]
    ends = endings[: len(lines)]
    if lines and lines[-1] and not last_ending:  # (an empty last line without an ending is no line)
        ends[-1] = b""
    return b"".join(line + end for line, end in zip(lines, ends))


@pytest.fixture(scope="module")
def fuzz_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=40, deadline=None)
@given(
    lines=LINES,
    endings=st.lists(st.sampled_from([b"\n", b"\r\n"]), min_size=25, max_size=25),
    last_ending=st.booleans(),
)
def test_fuzzed_corpus_keeps_every_valid_line_and_counts_every_junk_line(
    corpus, fuzz_folder, lines, endings, last_ending
):
    train = fuzz_folder / "train.tsv"
    train.write_bytes(corpus_bytes(lines, endings, last_ending))
    for reader in ("parallel_text", "image_captions"):
        reasons, expected = {}, []
        for number, (kind, value) in enumerate(lines, start=1):
            reason = expected_reason(kind, encoded(kind, value), reader)
            if reason:
                reasons.setdefault(reason, []).append(number)
            else:
                # a valid line, or for image_captions an empty image file name: both sides, stripped
                expected.append((number, *(side.decode().strip() for side in encoded(kind, value).split(b"\t"))))
        skipped = parallel_text.Skipped()
        if reader == "parallel_text":
            pairs = parallel_text.read_pairs([train], skipped)
            kept = [(int(p["origin"].split(":")[1]), p["source"], p["target"]) for p in pairs]
        else:
            kept = image_captions.read_lines(train, skipped)
        assert kept == expected
        assert dict(skipped.counts) == {reason: len(numbers) for reason, numbers in reasons.items()}
        assert skipped.examples == {
            reason: [f"{train}:{n}" for n in numbers[:5]] for reason, numbers in reasons.items()
        }
    valid = [tuple(side.strip() for side in value) for kind, value in lines if kind == "valid"]
    params = {**corpus, "train": str(train)}
    # and the whole build: the valid lines are the train split
    if valid:
        task = tasks.load_task("parallel_text", str(fuzz_folder / "data"), **params)
        assert [task.pair(r) for r in task.splits["train"]] == valid
    else:
        with pytest.raises(DataError, match=f"the train split is empty \\(from {escaped(train)}\\)"):
            tasks.load_task("parallel_text", str(fuzz_folder / "data"), **params)


def test_corpus_of_only_junk_is_an_empty_dataset_naming_the_file_and_the_reasons(corpus, tmp_path):
    train = tmp_path / "train.tsv"
    train.write_bytes(b"\xff\xfe\tbad\n\n one side only \na\tb\tc\n \tx\n")
    message = (
        f"parallel_text: the train split is empty (from {train}): skipped 1 line(s) with 1 tab-separated fields "
        f"instead of 2, e.g. {train}:3; skipped 1 line(s) with 3 tab-separated fields instead of 2, e.g. {train}:4; "
        f"skipped 1 line(s) with a blank line, e.g. {train}:2; skipped 1 line(s) with an empty side, e.g. {train}:5; "
        f"skipped 1 line(s) with invalid UTF-8, e.g. {train}:1"
    )
    with pytest.raises(DataError, match=f"^{re.escape(message)}$"):
        tasks.load_task("parallel_text", str(tmp_path / "data"), **{**corpus, "train": str(train)})
