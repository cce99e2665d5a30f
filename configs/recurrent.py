"""What the recurrent families' configs (`configs/<family>_<task>.py`) share.

    python train.py --config=configs/rnnsearch_dates.py --workdir=runs/rnnsearch_dates

`get_config(family, task)` starts from the task's Transformer config
(`configs/default.py` for the small tasks, `configs/kjv_web_transformer.py`)
and changes the batching, the schedule where it differs (`TASKS`) and the
model: the family's at the task's size (`model_fields`). The sizes are the
papers' shapes scaled to what trains in minutes on a CPU; the papers' own
sizes are the dataclass defaults in `models/rnn.py`.
"""

from __future__ import annotations

from configs import base, default, kjv_web_transformer
from utils.errors import ConfigError

FAMILIES = ("rnnencdec", "rnnsearch", "luong", "lstmn")


def _dates():
    """configs/default.py's task and schedule, with 64 bucketed examples a step."""
    config = default.get_config()
    config.update(
        num_train_steps=3_000, batch_size=64, learning_rate=3e-3, eval_every_steps=1_000, checkpoint_every_steps=1_000
    )
    config.data.max_target_length = 16
    config.data.bucket_boundaries = (16, 24, 32, 40, 48)
    return config


def _reverse():
    """The dates settings on `reverse`: strings of 5 to 40 symbols, backwards."""
    config = _dates()
    config.task = base.task("reverse", min_length=5, max_length=40, vocab_size=20)
    config.num_train_steps = 4_000
    config.data.max_target_length = 48
    return config


def _kjv_web():
    """configs/kjv_web_transformer.py's corpus, vocabulary, schedule and search."""
    config = kjv_web_transformer.get_config()
    # the Transformer's microbatches are its CPU tuning, not the recurrent families'
    config.grad_accum_steps = 1
    config.data.max_source_length = config.data.max_target_length = 96
    config.data.bucket_boundaries = (16, 32, 48, 64, 96)
    return config


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
    # tapes as long as the longest sequence the task's data settings allow
    if family == "lstmn":
        return dict(common, attention_dim=hidden, max_length=128 if small else 160)
    raise ConfigError(f"unknown recurrent family {family!r}; valid: {', '.join(FAMILIES)}")


def get_config(family: str, task: str, **model_overrides):
    config = TASKS[task]()
    config.model = base.model(family, **{**model_fields(family, task), **model_overrides})
    # the recurrent models read one example per row
    config.data.batching = "bucket"
    # its intra-attention, as the paper's figure 1 draws it
    config.visualize_self_attention = family == "lstmn"
    # Bahdanau et al. appendix B.2 clip the gradient norm at 1
    config.grad_clip_norm = 1.0
    # None of Cho, Bahdanau, Luong or Cheng et al. smooth the labels; base.py's 0.1 is the
    # Transformer's (Vaswani et al. section 5.4).
    config.label_smoothing = 0.0
    config.schedule = "cosine"
    return config
