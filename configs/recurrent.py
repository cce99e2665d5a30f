"""What the recurrent families' configs (`configs/<family>_<task>.py`) share.

    python train.py --config=configs/rnnsearch_dates.py --workdir=runs/rnnsearch_dates

`get_config(family, task)` starts from `configs/base.py` and sets the task's
data and schedule (`TASKS`) and the family's model at the task's size
(`model_fields`). The sizes are the papers' shapes scaled to what trains in
minutes on a CPU; the papers' own sizes are the dataclass defaults in
`models/rnn.py`.
"""

from __future__ import annotations

from configs import base

FAMILIES = ("rnnencdec", "rnnsearch", "luong")


def _dates(config):
    config.task = base.task("dates", train_size=20_000, dev_size=1_000, test_size=1_000)
    config.num_train_steps = 3_000
    config.batch_size = 64
    config.learning_rate = 3e-3
    config.warmup_steps = 200
    config.eval_every_steps = 1_000
    config.checkpoint_every_steps = 1_000
    config.log_every_steps = 100
    config.best_metric = "exact_match"
    config.best_metric_larger_is_better = True
    config.data.max_source_length = 48
    config.data.max_target_length = 16
    config.data.bucket_boundaries = (16, 24, 32, 40, 48)


def _reverse(config):
    config.task = base.task("reverse", min_length=5, max_length=40, vocab_size=20)
    config.num_train_steps = 4_000
    config.batch_size = 64
    config.learning_rate = 3e-3
    config.warmup_steps = 200
    config.eval_every_steps = 1_000
    config.checkpoint_every_steps = 1_000
    config.log_every_steps = 100
    config.best_metric = "exact_match"
    config.best_metric_larger_is_better = True
    config.data.max_source_length = 48
    config.data.max_target_length = 48
    config.data.bucket_boundaries = (16, 24, 32, 40, 48)


def _kjv_web(config):
    config.task = base.task("parallel_text")  # data/kjv_web/{train,dev,test}.tsv
    config.num_train_steps = 20_000
    config.batch_size = 64
    config.learning_rate = 1e-3
    config.warmup_steps = 1_000
    config.eval_every_steps = 2_000
    config.checkpoint_every_steps = 2_000
    config.eval_decode_examples = 200
    config.best_metric = "bleu"
    config.best_metric_larger_is_better = True
    config.tokenizer.kind = "sentencepiece"
    config.tokenizer.vocab_size = 8000
    config.data.max_source_length = 96
    config.data.max_target_length = 96
    config.data.bucket_boundaries = (16, 32, 48, 64, 96)
    config.decode.beam_size = 4


TASKS = {"dates": _dates, "reverse": _reverse, "kjv_web": _kjv_web}


def model_fields(family: str, task: str) -> dict:
    """The family's `config.model` fields at the task's size."""
    small = task != "kjv_web"
    hidden = 128 if small else 512
    common = dict(embed_dim=64 if small else 256, hidden_dim=hidden, dropout_rate=0.0 if small else 0.2)
    if family == "rnnencdec":
        return dict(common, cell="gru", maxout_dim=hidden // 2)
    if family == "rnnsearch":
        return dict(common, cell="gru", maxout_dim=hidden // 2, attention_dim=hidden)
    if family == "luong":
        layers = 1 if small else 2
        return dict(common, cell="lstm", num_encoder_layers=layers, num_decoder_layers=layers, score="general")
    raise ValueError(f"unknown recurrent family {family!r}; valid: {', '.join(FAMILIES)}")


def get_config(family: str, task: str):
    config = base.get_config()
    TASKS[task](config)
    config.model = base.model(family, **model_fields(family, task))
    config.data.batching = "bucket"  # the recurrent models read one example per row
    config.grad_clip_norm = 1.0  # Bahdanau et al. section 4.2 clip the gradient norm at 1
    config.schedule = "cosine"
    return base.lock(config)
