"""The paper's big Transformer on WMT 2014 English -> German (Vaswani et al. 2017, table 3).

    python train.py --config=configs/wmt14_transformer_big.py --workdir=runs/wmt14_big

As the base setup, with d_model 1024, 16 heads, d_ff 4096, dropout 0.3, 300k steps.
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
    return config
