"""The paper's Transformer on WMT 2014 English -> German (Vaswani et al. 2017, table 3): `:base` or `:big`.

    make prepare DATASET=wmt14_translate/de-en DATA_DIR=/path/to/tensorflow_datasets
    python train.py --config=configs/wmt14_transformer.py:base --workdir=runs/wmt14_base \
        --config.data_dir=/path/to/tensorflow_datasets
    python train.py --config=configs/wmt14_transformer.py:big --workdir=runs/wmt14_big ...

Needs `wmt14_translate/de-en` prepared as array_record in data_dir (or in $TFDS_DATA_DIR),
which the first command does (docs/usage.md, "Preparing a catalog dataset"). Shared 37000-piece
vocabulary (the paper's BPE), 100k steps, warmup 4000, peak rate
d_model^-0.5 * warmup^-0.5 = 7e-4, dropout 0.1, label smoothing 0.1, beam 4 with
length penalty 0.6 (section 5 and 6.1).

Batch: the paper's ~25000 source + ~25000 target tokens (section 5.1). 200 packed
rows of 128 tokens a side hold 25,600 token slots a side, so with first-fit
packing of short sentences (a few slots left empty per row) they carry just under
25,000 tokens a side; 400 rows would be twice the paper's batch.

Evaluation averages the last 5 checkpoints, as the paper does for the base model
(section 6.1: "written at 10-minute intervals"; 10 minutes of the paper's 0.4 s
steps is 1500 steps): `--mode=eval` evaluates them averaged beside the last one.

`:big` is the base setup with d_model 1024, 16 heads, d_ff 4096, dropout 0.3, 300k steps;
evaluation averages the last 20 checkpoints (section 6.1), written every 600 steps (10 minutes
of the paper's 1.0 s big-model steps).
"""

from configs import base
from utils.errors import ConfigError

SIZES = ("base", "big")


def get_config(size: str | None = None):
    """`size`: "base" or "big" (the part after the colon of `--config=FILE.py:SIZE`); none is base."""
    size = size or "base"
    if size not in SIZES:
        raise ConfigError(f"configs/wmt14_transformer.py:{size}: the size must be one of {', '.join(SIZES)}")

    config = base.get_config()
    # en -> de
    config.task = base.task("wmt14_translate/de-en", reverse=True)
    config.num_train_steps = 100_000
    config.batch_size = 200
    config.learning_rate = 512**-0.5 * 4000**-0.5
    config.warmup_steps = 4_000
    config.eval_every_steps = 5_000
    config.checkpoint_every_steps = 1_500
    config.keep_checkpoints = 5
    config.average_last = 5
    config.eval_decode_examples = 1_000
    config.best_metric = "bleu"
    config.tokenizer.kind = "sentencepiece"
    config.tokenizer.model_type = "bpe"
    config.tokenizer.vocab_size = 37_000
    config.data.batching = "pack"
    config.data.max_source_length = 128
    config.data.max_target_length = 128
    config.model.d_model = 512
    config.model.num_heads = 8
    config.model.num_encoder_layers = 6
    config.model.num_decoder_layers = 6
    config.model.d_ff = 2048
    config.decode.beam_size = 4
    config.decode.length_penalty = 0.6
    if size == "big":
        config.num_train_steps = 300_000
        config.learning_rate = 1024**-0.5 * 4000**-0.5
        config.model.d_model = 1024
        config.model.num_heads = 16
        config.model.d_ff = 4096
        config.model.dropout_rate = 0.3
        config.checkpoint_every_steps = 600
        config.keep_checkpoints = 20
        config.average_last = 20
    return config
