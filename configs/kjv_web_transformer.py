"""Transformer on the shipped kjv_web corpus (King James Version -> World English Bible).

    python train.py --config=configs/kjv_web_transformer.py --workdir=runs/kjv

3+3 layers, d_model 256, 4 heads, d_ff 1024, one shared 8000-piece SentencePiece
vocabulary, 64 packed rows of 128 tokens a step (in eight microbatches, two at a time), float32: the
size the performance comparisons (benchmarks/train_throughput.py) use.
"""

from configs import base


def get_config():
    config = base.get_config()
    # defaults: data/kjv_web/{train,dev,test}.tsv
    config.task = base.task("parallel_text")
    config.num_train_steps = 20_000
    config.batch_size = 64
    # The 64 rows as eight microbatches of 8, their gradients summed: the same update. Two of them in
    # each iteration of the loop, side by side: on a 2-core CPU the step is 2-3% faster than four
    # microbatches of 16 one at a time (the previous setting, itself 6-8% faster than two), and its
    # XLA buffer 0.59 GiB against 0.64 (a microbatch's activations and its [rows x 128 x 8000]
    # logits; four of 16 two at a time: 6% faster, 1.15 GiB). docs/performance.md, "What each
    # choice is worth" (benchmarks/step_variants.py). On a GPU, set both to 1.
    config.grad_accum_steps = 8
    config.grad_accum_unroll = 2
    config.learning_rate = 1e-3
    config.warmup_steps = 2_000
    config.eval_every_steps = 2_000
    config.checkpoint_every_steps = 2_000
    config.eval_decode_examples = 200
    config.best_metric = "bleu"
    config.tokenizer.kind = "sentencepiece"
    config.tokenizer.vocab_size = 8000
    config.data.batching = "pack"
    config.data.max_source_length = 128
    config.data.max_target_length = 128
    config.model.d_model = 256
    config.model.num_heads = 4
    config.model.num_encoder_layers = 3
    config.model.num_decoder_layers = 3
    config.model.d_ff = 1024
    config.decode.beam_size = 4
    return config
