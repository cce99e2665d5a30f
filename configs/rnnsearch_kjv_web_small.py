"""RNNsearch on kjv_web at JoeyNMT's size (the speed comparison of benchmarks/train_throughput.py).

    python train.py --config=configs/rnnsearch_kjv_web_small.py --workdir=runs/rnnsearch_small

configs/rnnsearch_kjv_web.py with JoeyNMT 2.3's RNN shapes: a bidirectional GRU
encoder of 256 units per direction, a GRU decoder of 256, additive attention of
256, embeddings of 256 and a maxout output of 128 over the shared 8000-piece
vocabulary; batches of about 4,096 padded slots (token batching: 256 rows of
sentences up to 16 tokens, 40 rows of sentences up to 96).
"""

from configs import recurrent


def get_config():
    config = recurrent.get_config("rnnsearch", "kjv_web", hidden_dim=256, attention_dim=256, maxout_dim=128)
    # the rows of a token batch are a multiple of it (and of the devices)
    config.batch_size = 8
    config.data.batch_tokens = 4096
    return config
