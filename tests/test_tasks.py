"""Tasks: determinism, correct targets, alignment spans, caching, bad input, the TFDS catalog path."""

import dataclasses
import datetime

import numpy as np
import pytest
import tensorflow_datasets as tfds
from babel import Locale
from tensorflow_datasets.core import shuffle

import tasks
from tasks import catalog, dates, parallel_text, synthetic
from utils.errors import DataError


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


# ---------------------------------------------------------------------- dates


@pytest.mark.parametrize(
    "date,pattern,locale,text,spans",
    [
        # v i e r n e s _ 3 _ d e _ a b r i l _ d e _ 2 0 2 0
        (
            datetime.date(2020, 4, 3),
            "EEEE d 'de' MMMM 'de' y",
            "es",
            "viernes 3 de abril de 2020",
            [(22, 26), (13, 18), (8, 9)],
        ),
        # t h e _ 2 2 n d _ o f _ M a r c h , _ 2 0 2 1
        (
            datetime.date(2021, 3, 22),
            "'the' {o} 'of' MMMM, y",
            "en",
            "the 22nd of March, 2021",
            [(19, 23), (12, 17), (4, 8)],
        ),
        (datetime.date(1999, 12, 31), "MM/dd/yy", "en", "12/31/99", [(6, 8), (0, 2), (3, 5)]),
        (datetime.date(1905, 1, 7), "d. MMMM y", "de", "7. Januar 1905", [(10, 14), (3, 9), (0, 1)]),
    ],
)
def test_render_hand_worked(date, pattern, locale, text, spans):
    rendered, alignment = dates.render(date, pattern, locale)
    assert rendered == text
    np.testing.assert_array_equal(alignment, spans)


def test_ordinals():
    days = [1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 31, 101, 111]
    expected = ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "31st", "101st", "111th"]
    assert [dates.ordinal(d) for d in days] == expected


def month_names(locale: str, month: int) -> set[str]:
    """Every CLDR name of `month` in `locale` (wide and abbreviated, format and stand-alone), lower-cased."""
    months = Locale.parse(locale).months
    return {months[context][width][month].lower() for context in months for width in ("wide", "abbreviated")}


def check_example(example):
    """The alignment spans of an example name the year, month and day of its ISO target."""
    source, target = example["source"], example["target"]
    year, month, day = (int(part) for part in target.split("-"))
    assert datetime.date(year, month, day).isoformat() == target
    (ys, ye), (ms, me), (ds, de) = example["alignment"]
    year_text, month_text, day_text = source[ys:ye], source[ms:me], source[ds:de]
    assert year_text in (str(year), f"{year % 100:02d}"), (source, year_text)
    assert int(day_text.lower().rstrip("stndrh")) == day, (source, day_text)
    locale = example["format"].split(":")[0]
    assert (month_text.isdigit() and int(month_text) == month) or month_text.lower() in month_names(locale, month), (
        source,
        month_text,
    )


def test_dates_targets_and_spans_are_right_for_every_format():
    config = dates.DatesConfig.create(train_size=3000, dev_size=200, test_size=200, seed=3)
    splits = dates.generate(config)
    for split in splits.values():
        for example in split:
            check_example(example)
    used = {e["format"] for e in splits["train"]}
    # every format shows up
    assert len(used) == len(dates.formats(dates.LANGUAGES))


def test_dates_are_deterministic_unambiguous_and_held_out():
    config = dates.DatesConfig.create(train_size=2000, dev_size=300, test_size=300)
    first, second = dates.generate(config), dates.generate(config)
    assert [e["source"] for e in first["train"]] == [e["source"] for e in second["train"]]
    other = dates.generate(dates.DatesConfig.create(train_size=2000, dev_size=300, test_size=300, seed=1))
    assert [e["source"] for e in other["train"]] != [e["source"] for e in first["train"]]
    target_of = {}
    for example in first["train"] + first["dev"] + first["test"]:
        assert target_of.setdefault(example["source"], example["target"]) == example["target"]
    held_out = {e["source"] for e in first["dev"] + first["test"]}
    assert not held_out & {e["source"] for e in first["train"]}
    assert [len(first[s]) for s in ("train", "dev", "test")] == [2000, 300, 300]


def test_dates_build_is_cached_and_rebuilt_when_parameters_change(data_dir):
    task = tasks.load_task("dates", data_dir, train_size=500, dev_size=50, test_size=50)
    assert task.metric == "exact_match"
    assert [len(task.splits[s]) for s in ("train", "dev", "test")] == [500, 50, 50]
    record = task.splits["test"][7]
    check_example(
        {
            **{k: tasks.task_builder.text(record[k]) for k in ("source", "target", "format")},
            "alignment": record["alignment"],
        }
    )
    files = sorted(p for p in (tfds.core.Path(data_dir) / "dates").glob("*/*/*.array_record*"))
    again = tasks.load_task("dates", data_dir, train_size=500, dev_size=50, test_size=50)
    assert sorted(p for p in (tfds.core.Path(data_dir) / "dates").glob("*/*/*.array_record*")) == files
    assert again.pair(again.splits["test"][7]) == task.pair(record)
    tasks.load_task("dates", data_dir, train_size=501, dev_size=50, test_size=50)
    assert len(list((tfds.core.Path(data_dir) / "dates").glob("*/*/dataset_info.json"))) == 2


def test_unknown_task_and_parameter_are_named(data_dir):
    with pytest.raises(ValueError, match="unknown task.name 'dtaes'.*dates"):
        tasks.load_task("dtaes", data_dir)
    with pytest.raises(ValueError, match="unknown task parameter.*trian_size"):
        tasks.load_task("dates", data_dir, trian_size=5)


# ------------------------------------------------------------------ synthetic


@pytest.mark.parametrize("kind", synthetic.KINDS)
def test_synthetic_targets_are_right(kind):
    config = synthetic.SyntheticConfig.create(
        kind=kind, min_length=5, max_length=30, train_size=300, dev_size=10, test_size=10
    )
    splits = synthetic.generate(config)
    assert splits == synthetic.generate(config)
    for example in splits["train"]:
        source, target = example["source"], example["target"]
        assert 5 <= len(source) <= 30
        if kind == "copy":
            assert target == source
        elif kind == "reverse":
            assert target == source[::-1]
        elif kind == "sort":
            assert sorted(target) == sorted(source) and all(
                synthetic.ALPHABET.index(a) <= synthetic.ALPHABET.index(b) for a, b in zip(target, target[1:])
            )
        else:
            left, right = source.split("+")
            assert int(target) == int(left) + int(right)
    lengths = {len(e["source"]) for e in splits["train"]}
    assert min(lengths) == 5 and max(lengths) == 30


def test_synthetic_vocabulary_and_bad_parameters():
    config = synthetic.SyntheticConfig.create(kind="copy", vocab_size=3, train_size=100, dev_size=1, test_size=1)
    assert set("".join(e["source"] for e in synthetic.generate(config)["train"])) <= set("012")
    with pytest.raises(ValueError, match="min_length"):
        synthetic.SyntheticConfig.create(kind="copy", min_length=10, max_length=5)


# -------------------------------------------------------------- parallel text


def test_shipped_kjv_web_corpus_loads(data_dir):
    task = tasks.load_task("parallel_text", data_dir)
    assert task.metric == "bleu"
    assert [len(task.splits[s]) for s in ("train", "dev", "test")] == [29108, 948, 1039]
    source, target = task.pair(task.splits["train"][0])
    assert source.startswith("And the earth was without form, and void")
    assert target.startswith("The earth was formless and empty")


def write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def test_malformed_lines_are_skipped_counted_and_reported(tmp_path, data_dir, caplog):
    train = write(
        tmp_path / "train.tsv",
        # 1 ok
        b"a b\tA B\n"
        # 2 wrong field count
        b"no tab here\n"
        # 3 wrong field count
        b"x\ty\tz\n"
        # 4 empty side
        b"\tonly target\n"
        # 5 invalid UTF-8
        b"bad \xff\xfe utf8\tok\n"
        # 6 ok
        b"c d\tC D\n",
    )
    dev = write(tmp_path / "dev.tsv", b"e\tE\n")
    test = write(tmp_path / "test.tsv", b"f\tF\n")
    task = tasks.load_task("parallel_text", data_dir, train=train, dev=dev, test=test)
    assert [task.pair(r) for r in task.splits["train"]] == [("a b", "A B"), ("c d", "C D")]
    log = caplog.text
    assert "skipped 1 line(s) with 1 tab-separated fields instead of 2, e.g. " + f"{train}:2" in log
    assert f"skipped 1 line(s) with 3 tab-separated fields instead of 2, e.g. {train}:3" in log
    assert f"skipped 1 line(s) with an empty side, e.g. {train}:4" in log
    assert f"skipped 1 line(s) with invalid UTF-8, e.g. {train}:5" in log


def test_line_aligned_files_and_derived_splits(tmp_path, data_dir):
    sources = "".join(f"source {i}\n" for i in range(400)).encode()
    targets = "".join(f"target {i}\n" for i in range(400)).encode()
    write(tmp_path / "corpus.de", sources)
    write(tmp_path / "corpus.en", targets)
    params = dict(
        train=str(tmp_path / "corpus"),
        dev="",
        test="",
        source_suffix="de",
        target_suffix="en",
        dev_fraction=0.1,
        test_fraction=0.1,
    )
    task = tasks.load_task("parallel_text", data_dir, **params)
    seen = {s: {task.pair(r) for r in task.splits[s]} for s in ("train", "dev", "test")}
    assert sum(len(v) for v in seen.values()) == 400
    assert not (seen["train"] & seen["dev"]) and not (seen["train"] & seen["test"]) and not (seen["dev"] & seen["test"])
    assert 20 < len(seen["dev"]) < 60 and 20 < len(seen["test"]) < 60
    # still aligned
    assert all(s.split()[1] == t.split()[1] for s, t in seen["train"])
    again = tasks.load_task("parallel_text", data_dir, **params)
    assert {task.pair(r) for r in again.splits["dev"]} == seen["dev"]


@pytest.mark.parametrize("layout", ["tsv", "line-aligned"])
def test_a_corpus_is_built_as_a_stream_in_shards_without_the_shuffler(tmp_path, data_dir, monkeypatch, caplog, layout):
    # TFDS's shuffler holds a split in memory and spills it through tf.io.gfile past 1 GB: never used
    monkeypatch.setattr(shuffle.Shuffler, "__init__", lambda *args, **kwargs: pytest.fail("shuffler used"))
    monkeypatch.setattr(tasks.task_builder, "SHARD_EXAMPLES", 7)
    lines = [(f"source {i}", f"target {i}") for i in range(120)] + [("", "no source")] * 3
    if layout == "tsv":
        write(tmp_path / "corpus.tsv", "".join(f"{s}\t{t}\r\n" for s, t in lines).encode())
        params = dict(train=str(tmp_path / "corpus.tsv"))
    else:
        write(tmp_path / "corpus.de", "".join(f"{s}\n" for s, _ in lines).encode())
        write(tmp_path / "corpus.en", "".join(f"{t}\n" for _, t in lines).encode())
        params = dict(train=str(tmp_path / "corpus"), source_suffix="de", target_suffix="en")
    task = tasks.load_task("parallel_text", data_dir, dev="", test="", dev_fraction=0.1, test_fraction=0.1, **params)
    # the reference: every line in memory, split by the hash of its pair, in file order
    expected = {"train": [], "dev": [], "test": []}
    for number, pair in enumerate(lines[:120], start=1):
        expected[parallel_text.held_out_split(pair, 0.1, 0.1)].append(
            (*pair, f"corpus.{'tsv' if layout == 'tsv' else 'de'}:{number}")
        )
    for split, records in task.splits.items():
        assert [(*task.pair(r), r["origin"].decode()) for r in records] == expected[split]
        # shards of 7 examples
        assert len(records.shards) == -(-len(expected[split]) // 7)
    assert "skipped 3 line(s) with an empty side" in caplog.text


def test_texts_are_serialized_as_tfds_serializes_them():
    from tensorflow_datasets.core import example_serializer
    from tensorflow_datasets.proto import tf_example_pb2

    features = tfds.features.FeaturesDict({"source": tfds.features.Text(), "target": tfds.features.Text()})
    reference = example_serializer.ExampleSerializer(features.get_serialized_info())
    for example in ({"source": "Grüße, ☃", "target": ""}, {"source": "a\tb", "target": "x" * 300}):
        ours, theirs = (
            tasks.task_builder.text_serializer(features)(example),
            reference.serialize_example(features.encode_example(example)),
        )
        # the same message; the bytes may differ only in the order of the feature map's entries, which
        # protobuf leaves to the implementation (and readers ignore)
        assert tf_example_pb2.Example.FromString(ours) == tf_example_pb2.Example.FromString(theirs)
        assert sorted(ours) == sorted(theirs)
    with_spans = tfds.features.FeaturesDict(
        {"source": tfds.features.Text(), "alignment": tfds.features.Tensor(shape=(3, 2), dtype=np.int32)}
    )
    # other features: TFDS's own serializer
    assert tasks.task_builder.text_serializer(with_spans) is None


def test_edited_file_is_rebuilt(tmp_path, data_dir):
    dev, test = write(tmp_path / "dev.tsv", b"e\tE\n"), write(tmp_path / "test.tsv", b"f\tF\n")
    train = write(tmp_path / "train.tsv", b"a\tA\n")
    assert tasks.load_task("parallel_text", data_dir, train=train, dev=dev, test=test).pair(
        tasks.load_task("parallel_text", data_dir, train=train, dev=dev, test=test).splits["train"][0]
    ) == ("a", "A")
    write(tmp_path / "train.tsv", b"b\tB\n")
    task = tasks.load_task("parallel_text", data_dir, train=train, dev=dev, test=test)
    assert task.pair(task.splits["train"][0]) == ("b", "B")


def test_the_files_digest_is_of_their_contents_and_parts_not_of_their_place(tmp_path, monkeypatch):
    """The same corpus in another folder (a fresh clone, a moved project) has the same digest, so the
    built data is found again; the same bytes in other parts (train and dev swapped) do not."""
    for place in ("one", "two"):
        (tmp_path / place / "corpus").mkdir(parents=True)
        write(tmp_path / place / "corpus" / "train.tsv", b"a\tA\nb\tB\n")
        write(tmp_path / place / "corpus" / "dev.tsv", b"c\tC\n")
        write(tmp_path / place / "corpus" / "test.tsv", b"d\tD\n")

    def digest(place, train="corpus/train.tsv", dev="corpus/dev.tsv"):
        monkeypatch.chdir(tmp_path / place)
        config = parallel_text.ParallelTextConfig(name="any", train=train, dev=dev, test="corpus/test.tsv")
        return parallel_text.with_digest(config, tmp_path / f"memo_{place}.json")["files_digest"]

    assert digest("one") == digest("two")
    assert digest("one", train="corpus/dev.tsv", dev="corpus/train.tsv") != digest("one")


def test_missing_file_mismatched_files_and_empty_split_are_named(tmp_path, data_dir):
    with pytest.raises(DataError, match="file not found: nowhere/train.tsv"):
        tasks.load_task("parallel_text", data_dir, train="nowhere/train.tsv")
    write(tmp_path / "c.de", b"a\nb\n")
    write(tmp_path / "c.en", b"A\n")
    with pytest.raises(ValueError, match="has 2 lines but .*c.en has 1"):
        tasks.load_task("parallel_text", data_dir, train=str(tmp_path / "c"), source_suffix="de", target_suffix="en")
    empty = write(tmp_path / "empty.tsv", b"\n\t\n")
    train = write(tmp_path / "t.tsv", b"a\tA\n")
    with pytest.raises(ValueError, match=f"the dev split is empty \\(from {empty}\\)"):
        tasks.load_task("parallel_text", data_dir, train=train, dev=empty, test=train)


# -------------------------------------------------------------- TFDS catalog


def test_catalog_languages_from_names():
    assert catalog.languages_of("wmt14_translate/de-en") == ("de", "en")
    assert catalog.languages_of("ted_hrlr_translate/pt_to_en") == ("pt", "en")
    with pytest.raises(ValueError, match="cannot tell the languages"):
        catalog.languages_of("some_dataset")


# Preparing catalog datasets with TFDS's real builders and reading them: tests/test_prepare_catalog.py.


def test_config_classes_are_dataclasses():
    for config_class in (dates.DatesConfig, synthetic.SyntheticConfig, parallel_text.ParallelTextConfig):
        assert dataclasses.is_dataclass(config_class)
