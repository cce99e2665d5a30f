"""The paper's base Transformer on WMT 2014 English -> German (Vaswani et al. 2017, table 3).

    make prepare DATASET=wmt14_translate/de-en DATA_DIR=/path/to/tensorflow_datasets
    python train.py --config=configs/wmt14_transformer_base.py --workdir=runs/wmt14_base \
        --config.data_dir=/path/to/tensorflow_datasets

Needs `wmt14_translate/de-en` prepared as array_record in data_dir (or in $TFDS_DATA_DIR),
which the first command does (README, "Preparing a catalog dataset"). Shared 37000-piece
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
"""

from configs import base


def get_config():
    config = base.get_config()
    config.task = base.task("wmt14_translate/de-en", reverse=True)  # en -> de
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
    return config
