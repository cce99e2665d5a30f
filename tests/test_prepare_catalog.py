"""Preparing the TFDS catalog offline: TFDS's real builders prepare archives made here, laid out as
their URLs serve them, in the preparation environment (.venv-prepare, one process for every
dataset); the training task (tasks/catalog.py, this environment, no TensorFlow) then reads them.

The archives' layouts follow the 4.9.10 builders' `_split_generators`: WMT's
(tensorflow_datasets/translate/wmt.py: `SubDataset` url and path of each corpus), TED's
(datasets/ted_hrlr_translate: `datasets/<pair>/<lang>.<split>`) and COCO's
(object_detection/coco.py, coco_captions.py: image zips, annotation JSONs, Karpathy's splits).
"""

import io
import json
import os
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import tasks
from tasks import catalog
from utils import files

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PREPARE_PYTHON = PROJECT_ROOT / ".venv-prepare" / "bin" / "python"
WORKER = PROJECT_ROOT / "tests" / "helpers" / "prepare_catalog_worker.py"

STATMT = "http://www.statmt.org/"
STATMT_DATA = "http://data.statmt.org/"
COCO = "http://images.cocodataset.org/"


def sentence_pairs(corpus: str, count: int = 2) -> list[tuple[str, str]]:
    """`count` (German, English) pairs, distinct per corpus, with non-ASCII text."""
    return [(f"Grüße aus {corpus}, Satz {i}.", f"Greetings from {corpus}, sentence {i}.") for i in range(count)]


def plain_files(path: str, pairs) -> dict[str, str]:
    """A line-aligned corpus as WMT ships it: `path.de` and `path.en`, one sentence a line."""
    return {f"{path}.de": "".join(f"{de}\n" for de, _ in pairs), f"{path}.en": "".join(f"{en}\n" for _, en in pairs)}


def sgm(pairs, side: int) -> str:
    """A newstest SGML file: one `<seg id="N">` a sentence inside a document."""
    segments = "".join(f'<seg id="{i + 1}">{pair[side]}</seg>\n' for i, pair in enumerate(pairs))
    return (
        '<srcset setid="newstest" srclang="any">\n<doc sysid="ref" docid="1" genre="news" origlang="de">\n<p>\n'
        f"{segments}</p>\n</doc>\n</srcset>\n"
    )


def sgm_files(name: str, pairs) -> dict[str, str]:
    return {f"dev/{name}-deen-src.de.sgm": sgm(pairs, 0), f"dev/{name}-deen-ref.en.sgm": sgm(pairs, 1)}


# The corpora of each split, as the builders list them for de-en (wmt14.py / wmt17.py `_subsets`,
# keeping those that have de-en), and the archive (URL) and member paths each comes from (wmt.py).
WMT_CORPORA = {
    "europarl_v7": (STATMT + "wmt13/training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en"),
    "commoncrawl": (STATMT + "wmt13/training-parallel-commoncrawl.tgz", "commoncrawl.de-en"),
    "newscommentary_v9": (STATMT + "wmt14/training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en"),
    "newscommentary_v12": (
        STATMT_DATA + "wmt17/translation-task/training-parallel-nc-v12.tgz",
        "training/news-commentary-v12.de-en",
    ),
    "rapid_2016": (STATMT_DATA + "wmt18/translation-task/rapid2016.tgz", "rapid2016.de-en"),
}
# every newstest, plain and SGML
WMT_DEV_URL = STATMT_DATA + "wmt19/translation-task/dev.tgz"
WMT_SPLITS = {
    "wmt14_translate/de-en": {
        "train": ["europarl_v7", "commoncrawl", "newscommentary_v9"],
        "dev": ["newstest2013"],
        "test": ["newstest2014"],
    },
    "wmt17_translate/de-en": {
        "train": ["europarl_v7", "commoncrawl", "newscommentary_v12", "rapid_2016"],
        "dev": ["newstest2016"],
        "test": ["newstest2017"],
    },
}


def wmt_archives() -> dict[str, dict[str, str]]:
    """`{url: {member path: text}}` of every archive the two WMT de-en builders fetch."""
    archives = {url: plain_files(path, sentence_pairs(corpus)) for corpus, (url, path) in WMT_CORPORA.items()}
    # plain text, unlike later years
    archives[WMT_DEV_URL] = {
        **plain_files("dev/newstest2013", sentence_pairs("newstest2013")),
        **{
            k: v
            for year in (2014, 2016, 2017)
            for k, v in sgm_files(f"newstest{year}", sentence_pairs(f"newstest{year}")).items()
        },
    }
    return archives


TED_URL = "http://www.phontron.com/data/qi18naacl-dataset.tar.gz"
TED_SPLITS = {"train": "train", "dev": "dev", "test": "test"}


def ted_archive() -> dict[str, str]:
    """Qi et al.'s archive for pt_to_en: `datasets/pt_to_en/{pt,en}.{train,dev,test}`."""
    members = {}
    for split in TED_SPLITS.values():
        pairs = [(de.replace("Grüße", "Saudações"), en) for de, en in sentence_pairs(f"ted {split}", 3)]
        members[f"datasets/pt_to_en/pt.{split}"] = "".join(f"{pt}\n" for pt, _ in pairs)
        members[f"datasets/pt_to_en/en.{split}"] = "".join(f"{en}\n" for _, en in pairs)
    return members


def expected_pairs(name: str, split: str) -> set[tuple[str, str]]:
    if name.startswith("ted_hrlr"):
        return {(de.replace("Grüße", "Saudações"), en) for de, en in sentence_pairs(f"ted {TED_SPLITS[split]}", 3)}
    return {pair for corpus in WMT_SPLITS[name][split] for pair in sentence_pairs(corpus)}


# COCO 2014 as Karpathy and Li split it: train images come from train2014, val/test/restval from val2014.
# file name: (Karpathy split, solid colour)
COCO_IMAGES = {
    "COCO_train2014_000000000009.jpg": ("train", (200, 40, 40)),
    "COCO_train2014_000000000025.jpg": ("train", (40, 200, 40)),
    "COCO_val2014_000000000042.jpg": ("val", (40, 40, 200)),
    "COCO_val2014_000000000073.jpg": ("test", (200, 200, 40)),
    "COCO_val2014_000000000074.jpg": ("restval", (40, 200, 200)),
}
COCO_CAPTION_SPLITS = {"train": ("train", "restval"), "dev": ("val",), "test": ("test",)}


def coco_captions_of(filename: str) -> list[str]:
    return [f"caption {c} of {filename.split('_')[-1].removesuffix('.jpg')}" for c in range(5)]


def jpeg(colour, size=(12, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def coco_archives() -> dict[str, dict[str, bytes | str]]:
    """The seven COCO 2014 zips coco.py fetches and Karpathy's caption_datasets.zip."""
    image_ids = {name: int(name.split("_")[-1].removesuffix(".jpg")) for name in COCO_IMAGES}
    # coco.py wants 80
    categories = [{"id": i + 1, "name": f"category{i}", "supercategory": "thing"} for i in range(80)]

    def instances(year_split: str) -> str:
        images = [
            {"id": image_ids[name], "file_name": name, "height": 8, "width": 12}
            for name in COCO_IMAGES
            if year_split in name
        ]
        boxes = [
            {
                "id": 1000 + image["id"],
                "image_id": image["id"],
                "bbox": [1.0, 1.0, 4.0, 3.0],
                "area": 12,
                "category_id": 1,
                "iscrowd": 0,
            }
            for image in images
        ]
        return json.dumps({"images": images, "annotations": boxes, "categories": categories})

    def test_info(year_split: str) -> str:
        return json.dumps(
            {
                "images": [{"id": 1, "file_name": f"COCO_{year_split}_000000000001.jpg", "height": 8, "width": 12}],
                "categories": categories,
            }
        )

    archives = {
        COCO + f"zips/{year_split}.zip": {
            f"{year_split}/{name}": jpeg(colour) for name, (_, colour) in COCO_IMAGES.items() if year_split in name
        }
        for year_split in ("train2014", "val2014")
    }
    # fetched and extracted by coco.py, unused by coco_captions
    for year_split in ("test2014", "test2015"):
        archives[COCO + f"zips/{year_split}.zip"] = {
            f"{year_split}/COCO_{year_split}_000000000001.jpg": jpeg((0, 0, 0))
        }
        archives[COCO + f"annotations/image_info_{year_split}.zip"] = {
            f"annotations/image_info_{year_split}.json": test_info(year_split)
        }
    archives[COCO + "annotations/annotations_trainval2014.zip"] = {
        f"annotations/instances_{s}.json": instances(s) for s in ("train2014", "val2014")
    }
    karpathy = [
        {
            "filename": name,
            "split": split,
            "sentences": [
                {"raw": text, "sentid": 10 * image_ids[name] + c} for c, text in enumerate(coco_captions_of(name))
            ],
        }
        for name, (split, _) in COCO_IMAGES.items()
    ]
    archives["https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip"] = {
        "dataset_coco.json": json.dumps({"images": karpathy, "dataset": "coco"})
    }
    return archives


def write_archive(path: Path, members: dict[str, bytes | str]) -> Path:
    """A `.zip` or gzipped tar of `members` at `path`."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w") as archive:
            for member, data in members.items():
                archive.writestr(member, data)
        return path
    with tarfile.open(path, "w:gz") as archive:
        for member, data in members.items():
            data = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def write_fixtures(folder: Path) -> Path:
    """Every archive the four builders fetch, under `folder`, and `downloads.json` mapping each URL to it."""
    archives = {**wmt_archives(), TED_URL: ted_archive(), **coco_archives()}
    files = {}
    for index, (url, members) in enumerate(archives.items()):
        files[url] = str(write_archive(folder / f"{index}_{url.rsplit('/', 1)[-1]}", members))
    downloads = folder / "downloads.json"
    downloads.write_text(json.dumps(files))
    return downloads


DATASETS = ["wmt14_translate/de-en", "wmt17_translate/de-en", "ted_hrlr_translate/pt_to_en", "coco_captions"]


@pytest.fixture(scope="session")
def prepared_data_dir(tmp_path_factory):
    """A data_dir where the preparation environment prepared all four datasets from the fixtures,
    once per session: pytest-xdist's workers share it (the first prepares, under a lock)."""
    if not PREPARE_PYTHON.exists():
        pytest.skip(f"needs the preparation environment {PREPARE_PYTHON.parent.parent} (make prepare-env)")
    shared = tmp_path_factory.getbasetemp()
    # the session's folder, above the workers'
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    folder, data_dir = shared / "catalog", shared / "catalog" / "tfds"
    with files.exclusive(shared / "catalog.lock"):
        if not (folder / "prepared").exists():
            folder.mkdir(exist_ok=True)
            prepare_from_fixtures(folder, data_dir)
            (folder / "prepared").touch()
    return data_dir


def prepare_from_fixtures(folder: Path, data_dir: Path) -> None:
    """Writes the fixtures into `folder` and prepares every dataset from them into `data_dir`, in
    one process of the preparation environment (TensorFlow imported once)."""
    downloads = write_fixtures(folder)
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    environment.pop("TFDS_DATA_DIR", None)
    started = time.perf_counter()
    result = subprocess.run(
        [str(PREPARE_PYTHON), str(WORKER), str(downloads), str(data_dir), *DATASETS],
        cwd=PROJECT_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"prepared {len(DATASETS)} datasets in {time.perf_counter() - started:.1f} s")


@pytest.mark.parametrize(
    "name,reverse",
    [("wmt14_translate/de-en", False), ("wmt17_translate/de-en", True), ("ted_hrlr_translate/pt_to_en", False)],
)
def test_prepared_translation_dataset_is_read_by_the_catalog_task(prepared_data_dir, name, reverse):
    task = tasks.load_task(name, str(prepared_data_dir), reverse=reverse)
    source, target = catalog.languages_of(name)[::-1] if reverse else catalog.languages_of(name)
    assert (task.source_key, task.target_key, task.metric) == (source, target, "bleu")
    for split in ("train", "dev", "test"):
        pairs = {task.pair(task.splits[split][i]) for i in range(len(task.splits[split]))}
        expected = expected_pairs(name, split)
        assert pairs == ({(b, a) for a, b in expected} if reverse else expected), split


def test_prepared_coco_captions_is_read_by_the_catalog_task(prepared_data_dir):
    task = tasks.load_task("coco_captions", str(prepared_data_dir), height=6, width=9)
    assert (task.metric, task.inputs) == ("caption", "image")
    colours = {name: colour for name, (_, colour) in COCO_IMAGES.items()}
    for split, karpathy_splits in COCO_CAPTION_SPLITS.items():
        names = [name for name, (s, _) in COCO_IMAGES.items() if s in karpathy_splits]
        records = [task.splits[split][i] for i in range(len(task.splits[split]))]
        # five captions an image
        assert len(records) == 5 * len(names), split
        assert {(r["image_file"], r["caption"]) for r in records} == {
            (n, c) for n in names for c in coco_captions_of(n)
        }
        for record in records:
            image = task.image(record)
            assert image.shape == (6, 9, 3)
            # JPEG's loss
            np.testing.assert_allclose(image.reshape(-1, 3).mean(0), colours[record["image_file"]], atol=6)


def test_unprepared_dataset_names_the_command_that_prepares_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
    with pytest.raises(ValueError) as error:
        tasks.load_task("wmt14_translate/de-en", str(tmp_path))
    message = str(error.value)
    assert "\n" not in message
    assert f"make prepare DATASET=wmt14_translate/de-en DATA_DIR={tmp_path}" in message


def test_unknown_catalog_name_is_refused_with_close_names(tmp_path):
    with pytest.raises(ValueError, match="unknown TFDS catalog dataset 'wmt14_translat'.*wmt14_translate"):
        tasks.load_task("wmt14_translat/de-en", str(tmp_path))
    with pytest.raises(ValueError, match="wmt14_translate has no config 'xx-en'; its configs: .*de-en"):
        tasks.load_task("wmt14_translate/xx-en", str(tmp_path))


def test_tfds_data_dir_is_where_a_dataset_not_in_data_dir_is_read(prepared_data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(prepared_data_dir))
    task = tasks.load_task("ted_hrlr_translate/pt_to_en", str(tmp_path / "empty"))
    assert len(task.splits["dev"]) == 3


def test_prepare_command_refuses_an_unknown_name_in_one_line(tmp_path, capsys):
    # imports TFDS alone: its checks of a name run in this environment too
    from tools import prepare_catalog

    assert prepare_catalog.main(["coco_captoins", f"--data_dir={tmp_path}"]) == 2
    assert (
        capsys.readouterr().err
        == "prepare_catalog: unknown TFDS catalog dataset 'coco_captoins'; did you mean coco_captions?\n"
    )
    # nothing written
    assert not any(tmp_path.iterdir())


def test_prepare_command_names_manual_dir_when_files_are_missing(tmp_path, monkeypatch, capsys):
    """TFDS's builders report a missing manual download as an AssertionError (download_manager.py
    `manual_dir`, wmt.py `_check_manual_files`); the command shows it as one line with the option."""
    from tools import prepare_catalog

    class NeedsManualFiles:
        def download_and_prepare(self, download_config, file_format):
            assert download_config.manual_dir == str(tmp_path / "manual") and file_format == "array_record"
            raise AssertionError(
                f"Manual directory {tmp_path}/manual does not exist or is empty.\nCreate it and download"
            )

    monkeypatch.setattr(prepare_catalog, "builder_of", lambda name, data_dir: NeedsManualFiles())
    assert prepare_catalog.main(["wmt14_translate/cs-en", f"--manual_dir={tmp_path / 'manual'}"]) == 2
    assert capsys.readouterr().err == (
        f"prepare_catalog: wmt14_translate/cs-en: Manual directory {tmp_path}/manual does not "
        "exist or is empty. Create it and download (give that folder with --manual_dir=DIR)\n"
    )
