"""The paper's big Transformer on WMT 2014 English -> German (Vaswani et al. 2017, table 3).

    python train.py --config=configs/wmt14_transformer_big.py --workdir=runs/wmt14_big

As the base setup, with d_model 1024, 16 heads, d_ff 4096, dropout 0.3, 300k steps;
evaluation averages the last 20 checkpoints (section 6.1), written every 600
steps (10 minutes of the paper's 1.0 s big-model steps).
"""

from configs import wmt14_transformer_base


def get_config():
    config = wmt14_transformer_base.get_config()
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
