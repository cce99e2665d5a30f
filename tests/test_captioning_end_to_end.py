"""Captioning through the common trainer, evaluator and data pipeline: digit_strips end to end,
image_captions from a folder, the localisation metric, and the mismatches that must stop early."""

import json

import jax
import numpy as np
import pytest
from PIL import Image

from configs import base
from engine import exported_step, training_loop
from helpers.subprocess_runs import assert_same_final_state, wrap_train_steps
from helpers.tiny import TINY_CAPTIONER, captioning_config, tiny_config
from run_setup.settings import parse
from scoring import metrics, score_registry
from tasks import image_captions, load_task
from tools import compare_runs
from utils.errors import ConfigError, DataError


def test_localization_counts_hand_worked():
    # a 1 x 3 grid of 4-pixel cells
    centres = np.array([[2.0, 2.0], [6.0, 2.0], [10.0, 2.0]])
    # two digits, then none
    boxes = np.array([[0, 0, 4, 4], [8, 0, 12, 4], [-1, -1, -1, -1]])
    # the 2nd word looks between the digits
    weights = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [1.0, 0.0, 0.0]])
    assert metrics.localization_counts(weights, 2, boxes, centres) == (1, 2)
    # a word too many: not scored
    assert metrics.localization_counts(weights, 3, boxes, centres) == (0, 0)


def test_evaluator_localizes_each_real_rows_words_before_eos():
    """`Evaluator.localization` on stub attention: a caption's words are its tokens before eos, padding
    rows are not scored, and a caption with a word too many scores nothing."""
    from types import SimpleNamespace

    from engine import evaluation
    from models.attention import AttentionRole

    # a 1 x 3 grid of a 4 x 12 image
    centres = np.array([[2.0, 2.0], [6.0, 2.0], [10.0, 2.0]])
    weights = np.zeros((3, 1, 4, 3))
    # row 0: "w1 w2 eos", w1 on box 1, w2 on box 2's right cell
    weights[0, 0, [0, 1, 2], [0, 2, 1]] = 1.0
    # row 1: four words and no eos, against two boxes
    weights[1, 0, [0, 1], [1, 1]] = 1.0
    # row 2: padding
    weights[2, 0, 0, 0] = 1.0
    stub = SimpleNamespace(
        attention=lambda params, batch: {"attention": weights},
        roles={"attention": AttentionRole.CROSS},
        concrete_model=SimpleNamespace(cell_centres=lambda height, width: centres),
    )
    decoded = np.array([[5, 6, 2, 0], [5, 6, 7, 8], [5, 2, 0, 0]])
    boxes = np.array([[[0, 0, 4, 4], [8, 0, 12, 4]]] * 3)
    hits_total = evaluation.Evaluator.localization(
        stub, None, {"inputs": np.zeros((3, 4, 12, 1))}, decoded, boxes, np.array([0, 1, -1])
    )
    assert hits_total == (2, 2)


def test_caption_metrics_use_every_reference():
    results = score_registry.text_scores(
        "caption", ["a dog runs", "two cats"], [["a dog runs fast", "a dog runs"], ["one cat"]]
    )
    assert results["exact_match"] == 0.5
    assert results["bleu_1"] > results["bleu_4"] >= 0.0


@pytest.mark.slow
def test_digit_strips_train_and_evaluate_writes_the_caption_metrics_and_pictures(shared_data_dir, tmp_path):
    final = training_loop.train_and_evaluate(parse(captioning_config(shared_data_dir)), tmp_path)
    saved = json.loads((tmp_path / "eval" / "step_4.json").read_text())
    for split in ("dev", "test"):
        # localisation: below
        for name in ("exact_match", "bleu", "bleu_1", "bleu_4", "localized_words"):
            assert name in saved[split] and saved[split][name] == final[split][name]
    assert (tmp_path / "attention" / "step_4" / "example_0_caption.png").is_file()
    # what report/pages.py's explorer reads
    saved = np.load(tmp_path / "attention" / "step_4" / "example_0.npz")
    assert saved["boxes"].shape[1] == 4 and saved["centres"].shape == (saved["weights"].shape[1], 2)
    assert "grid over the image" in (tmp_path / "report.html").read_text()


def test_captions_and_translation_models_do_not_mix(shared_data_dir, tmp_path):
    with pytest.raises(ConfigError, match="pair a captioning task with model.name='captioner'"):
        training_loop.train_and_evaluate(parse(_text_model_on_strips(shared_data_dir)), tmp_path)
    with pytest.raises(ConfigError, match="reads image"):
        config = tiny_config(shared_data_dir)
        config.unlock()
        config.model = base.model("captioner")
        training_loop.train_and_evaluate(parse(config), tmp_path)
    with pytest.raises(ConfigError, match="model.channels = 3; set model.channels=1"):
        training_loop.train_and_evaluate(parse(captioning_config(shared_data_dir, **{"model.channels": 3})), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def _text_model_on_strips(data_dir):
    config = captioning_config(data_dir)
    config.unlock()
    config.model = base.model("rnnsearch")
    return config


def write_image(path, value):
    Image.fromarray(np.full((10, 14, 3), value, np.uint8)).save(path)


def test_image_captions_reads_a_folder_and_reports_bad_lines(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for name, value in (("a.png", 10), ("b.png", 200)):
        write_image(images / name, value)
    (images / "broken.png").write_bytes(b"not a png")
    lines = [
        "a.png\ta grey square",
        "a.png\ta dark square",
        "b.png\ta light square",
        "b.png\t",
        "no tab here",
        "broken.png\tunreadable",
        "missing.png\tnot there",
    ]
    for split in ("train", "dev", "test"):
        (tmp_path / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    params = dict(
        images=str(images),
        height=6,
        width=8,
        channels=1,
        **{split: str(tmp_path / f"{split}.tsv") for split in ("train", "dev", "test")},
    )
    task = load_task("image_captions", str(tmp_path / "tfds"), **params)
    train = task.splits["train"]
    assert len(train) == 3 and task.image(train[0]).shape == (6, 8, 1)
    assert task.references("dev", [0, 2]) == [["a grey square", "a dark square"], ["a light square"]]
    # the build's report, reloaded
    _, report = image_captions.prepare_image_captions(str(tmp_path / "tfds"), **params)
    assert report["skipped"] == {
        "an empty caption": 3,
        "1 tab-separated fields instead of 2": 3,
        "a missing or unreadable image": 6,
    }
    assert any(f"{tmp_path / 'train.tsv'}:6" in message for message in report["messages"])
    with pytest.raises(DataError, match="task.images must be the folder"):
        load_task("image_captions", str(tmp_path / "tfds"), **{**params, "images": str(tmp_path / "nowhere")})


class Crash(Exception):
    """What ends the cut run inside a train step."""


@pytest.mark.slow
def test_hard_attention_resumes_bit_identical_after_a_crash_inside_a_step(
    shared_data_dir, tmp_path, monkeypatch, caplog
):
    """The sampler's keys come from the step and the moving-average baseline is checkpointed with
    the parameters, so a hard-attention run that died inside step 30 (its checkpoint at 20 committed,
    rows written up to 28) and was run again ends where an uninterrupted one does, bit for bit. The
    three runs share this process: what a SIGKILL leaves on disk and how a new process resumes from
    it is test_crash_recovery.py's (the Transformer's); this test is about the captioner's state."""
    config = base.load(
        "configs/captioner_hard_digit_strips.py",
        [
            f"--config.data_dir={shared_data_dir}",
            "--config.task.train_size=96",
            "--config.task.dev_size=8",
            "--config.task.test_size=8",
            "--config.batch_size=8",
            "--config.warmup_steps=2",
            "--config.log_every_steps=2",
            *[f"--config.model.{k}={v}" for k, v in TINY_CAPTIONER.items()],
            "--config.num_train_steps=60",
            "--config.checkpoint_every_steps=20",
            "--config.eval_every_steps=60",
            "--config.visualize_examples=0",
            "--config.curves_png=false",
        ],
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    training_loop.train_and_evaluate(parse(config), whole)

    cached = exported_step.cached

    def crashing_at_step_30(step_function):
        def step(state, batch):
            if int(jax.device_get(state["step"])) + 1 == 30:
                raise Crash("inside step 30")
            return step_function(state, batch)

        return step

    wrap_train_steps(crashing_at_step_30, install=monkeypatch.setattr)
    with pytest.raises(Crash):
        training_loop.train_and_evaluate(parse(config), cut)
    assert sorted(int(p.name) for p in (cut / "checkpoints").iterdir() if p.name.isdigit()) == [20]
    assert max(r["step"] for r in compare_runs.metric_rows(cut)) == 28

    monkeypatch.setattr(exported_step, "cached", cached)
    with caplog.at_level("INFO"):
        training_loop.train_and_evaluate(parse(config), cut)
    assert "resuming from the checkpoint at step 20" in caplog.text
    assert compare_runs.metric_rows(cut) == compare_runs.metric_rows(whole)
    state = assert_same_final_state(config, whole, cut, 60)
    # the baseline moved (log-likelihoods are negative)
    assert float(state["model_state"]["baseline"]) < 0.0


def test_coco_captions_records_from_a_source_in_its_layout(tmp_path, monkeypatch):
    """TFDS's coco_captions builder needs TensorFlow to be constructed (mock data included), which
    this project does not install; its records are checked here from a source in the builder's
    feature layout (an image of any size, `image/filename`, `captions: {text: [...]}`).
    tests/test_prepare_catalog.py prepares and reads the real builder's output."""
    from types import SimpleNamespace

    from tasks import catalog

    images = [np.full((20 + i, 30, 3), 40 * i, np.uint8) for i in range(3)]
    source = [
        {
            "image": image,
            "image/filename": f"img{i}.jpg".encode(),
            "captions": {"text": [f"caption {i}.{c}" for c in range(5 if i else 2)]},
        }
        for i, image in enumerate(images)
    ]
    monkeypatch.setattr(
        catalog, "prepared_builder", lambda name, data_dir: SimpleNamespace(as_data_source=lambda split: source)
    )
    task = load_task("coco_captions", str(tmp_path), height=12, width=10)
    assert (task.metric, task.inputs) == ("caption", "image")
    # five captions an image
    assert [len(task.splits[s]) for s in ("train", "dev", "test")] == [15, 15, 15]
    record = task.splits["dev"][7]
    assert task.image(record).shape == (12, 10, 3) and int(task.image(record)[0, 0, 0]) == 40
    assert task.pair(record)[1] == "caption 1.2"
    assert task.references("dev", [7])[0] == [f"caption 1.{c}" for c in range(5)]
    # an image with two captions repeats them
    assert task.pair(task.splits["dev"][3])[1] == "caption 0.1"
