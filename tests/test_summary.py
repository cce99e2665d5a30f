"""The start-up summary: the estimate of an epoch and the batch, and its text on a hand-made run
(test_train.py's README corpus command checks a real run's log for it)."""

import dataclasses

import numpy as np
import pytest

from run_setup import summary
from run_setup.settings import PipelineSettings
from utils import metric_writer

DATA = PipelineSettings(
    batch_size=2,
    seed=0,
    max_source_length=8,
    max_target_length=6,
    length_policy="trim",
    batching="bucket",
    bucket_boundaries=(4, 8),
    batch_tokens=0,
    num_threads=1,
    prefetch_batches=0,
)
# the third's target is trimmed to 6: totals 22 source, 17 target
LENGTHS = np.array([[3, 2], [4, 4], [7, 9], [8, 5]])


def test_epoch_estimate_of_buckets_and_of_packed_rows_by_hand():
    steps, tokens = summary.epoch_estimate(LENGTHS, DATA)
    # 4 examples in rows of 2
    assert steps == 2 and tokens == (11, 8.5)
    # with batch_tokens=16, bucket 4 takes 16 // 4 // 2 * 2 = 4 rows, bucket 8 takes 2: 2/4 + 2/2 steps
    steps, tokens = summary.epoch_estimate(LENGTHS, dataclasses.replace(DATA, batch_tokens=16))
    assert steps == 1.5 and tokens == pytest.approx((22 / 1.5, 17 / 1.5))
    # packing: rows of 2 x 8 source / 2 x 6 target slots hold 22 / 16 and 17 / 12 of them: the target side binds
    steps, tokens = summary.epoch_estimate(LENGTHS, dataclasses.replace(DATA, batching="pack"))
    assert steps == pytest.approx(17 / 12) and tokens == pytest.approx((22 * 12 / 17, 12))


FACTS = summary.Facts(
    backend="cpu",
    devices=["8 x cpu"],
    processes=2,
    parameters={"encoder": 1200, "decoder": 3400},
    splits={"train": (4, 22, 17), "dev": (3, None, None)},
    batch_rows=2,
    batch_tokens=(11.0, 8.5),
    steps_per_epoch=2.0,
    num_train_steps=10,
    start_step=4,
    vocabulary="char, 40 ids, shared",
    vocabulary_folder="runs/x/tokenizer",
    workdir="runs/x",
    outputs=(("config.json", "the resolved config"),),
    malloc="huge pages",
)


def test_the_summary_of_a_hand_made_run():
    assert summary.format_summary(FACTS) == "\n".join(
        [
            "start-up summary",
            "devices:     cpu: 8 x cpu; 2 processes; malloc: huge pages",
            "parameters:  4,600 (decoder 3,400, encoder 1,200)",
            "data:        train 4 examples, 22 source + 17 target tokens; dev 3 examples",
            # 8.5 rounds to even
            "batch:       2 rows, about 11 source + 8 target tokens a step",
            "steps:       10 (from step 4); about 2.0 a train epoch, 3.0 epochs to go",
            "vocabulary:  char, 40 ids, shared in runs/x/tokenizer",
            "workdir:     runs/x",
            "             config.json    the resolved config",
        ]
    )
    image_like = dataclasses.replace(FACTS, splits={"train": (4, None, 17)}, batch_tokens=(None, 8.5), processes=1)
    assert "train 4 examples, 17 target tokens\n" in summary.format_summary(image_like)
    assert "8 target tokens a step" in summary.format_summary(
        image_like
    ) and "cpu: 8 x cpu; 1 process; malloc" in summary.format_summary(image_like)


def test_the_estimate_to_the_end():
    assert metric_writer.estimate_line(3600 * 30, 1.0).startswith(
        "about 30:00:00 of training to the end (108,000 steps at 1.00 steps/s"
    )
    assert metric_writer.estimate_line(5, 0.0) == "5 steps to the end (no rate measured yet)"
