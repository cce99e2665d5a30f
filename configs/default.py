"""The embedded default: a small Transformer on `dates` (written dates -> ISO 8601).

    python train.py                       # = --config=configs/default.py into runs/default-<time>
    python train.py --config=configs/default.py --workdir=runs/dates --config.num_train_steps=500

A 2+2-layer Transformer (d_model 128, 4 heads, d_ff 512) at character level, 32 packed rows of 48 source / 32 target
characters (about 80 examples a step), 2000 steps with a cosine schedule: about five minutes on
2 CPU cores, over 99% exact match on the test split.
"""

from configs import base


def get_config():
    config = base.get_config()
    config.task = base.task("dates", train_size=20_000, dev_size=1_000, test_size=1_000)
    config.num_train_steps = 2_000
    config.batch_size = 32
    config.learning_rate = 2e-3
    config.warmup_steps = 200
    config.schedule = "cosine"
    config.eval_every_steps = 500
    config.checkpoint_every_steps = 500
    config.log_every_steps = 100
    config.best_metric = "exact_match"
    config.data.batching = "pack"
    config.data.max_source_length = 48
    config.data.max_target_length = 32
    config.model = base.model(
        "transformer", d_model=128, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=512
    )
    return config
