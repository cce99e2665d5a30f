"""The TensorBoard event files a run writes, read back with TensorBoard's own reader (the program
of requirements-tensorboard.txt, which `tensorboard --logdir` runs): every scalar of metrics.jsonl
and every attention picture of each evaluation, at its step."""

import io
import json
import math

import numpy as np
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator


def load_events(folder) -> event_accumulator.EventAccumulator:
    accumulator = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.IMAGES: 0}
    )
    accumulator.Reload()
    return accumulator


def test_metric_writer_reads_the_metrics_and_the_attention_pictures(finished_run):
    _, workdir, _ = finished_run
    events = load_events(workdir / "tensorboard")
    # tag -> {step: value}, from metrics.jsonl: the numbers of each row but flags
    expected = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for name, value in row.items():
            if name not in ("step", "split") and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault(f"{row['split']}/{name}", {})[row["step"]] = value
    assert {"train/loss", "dev/loss", "test/exact_match", "data/train_examples"} <= set(expected)
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        read = {event.step: event.value for event in events.Scalars(tag)}
        assert read.keys() == by_step.keys(), tag
        # TensorBoard keeps float32
        for step, value in by_step.items():
            assert math.isclose(read[step], value, rel_tol=1e-6, abs_tol=1e-30), (tag, step, read[step], value)

    # step -> {name: (width, height)}, from the PNG files of attention/step_<N>/
    pictures = {}
    for folder in (workdir / "attention").glob("step_*"):
        pictures[int(folder.name.removeprefix("step_"))] = {
            path.stem: Image.open(path).size for path in folder.glob("*.png")
        }
    assert sorted(pictures) == [10, 20] and all(pictures.values())
    read = {}
    for tag in events.Tags()["images"]:
        assert tag.startswith("attention/"), tag
        for event in events.Images(tag):
            image = Image.open(io.BytesIO(event.encoded_image_string))
            assert (event.width, event.height) == image.size and np.asarray(image).ndim == 3
            read.setdefault(event.step, {})[tag.removeprefix("attention/")] = image.size
    assert {step: set(names) for step, names in read.items()} == {step: set(names) for step, names in pictures.items()}
    # the same picture, drawn at another resolution than the PNG file's
    for step, names in pictures.items():
        for name, (width, height) in names.items():
            assert math.isclose(read[step][name][0] / read[step][name][1], width / height, rel_tol=0.01), (step, name)
