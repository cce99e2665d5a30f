"""The embedded default: a small Transformer on `dates` (written dates -> ISO 8601).

    python train.py                       # = --config=configs/default.py into runs/default-<time>
    python train.py --config=configs/default.py --workdir=runs/dates --config.num_train_steps=500

Character-level, bucketed batches; about four minutes on 2 CPU cores.
"""

from configs import base


def get_config():
    config = base.get_config()
    config.task = base.task("dates", train_size=20_000, dev_size=1_000, test_size=1_000)
    config.num_train_steps = 3_000
    config.batch_size = 128
    config.learning_rate = 2e-3
    config.warmup_steps = 300
    config.eval_every_steps = 1_000
    config.checkpoint_every_steps = 1_000
    config.best_metric = "exact_match"
    config.best_metric_larger_is_better = True
    config.data.max_source_length = 48
    config.data.max_target_length = 12
    config.decode.max_length_offset = 12
    return base.lock(config)
