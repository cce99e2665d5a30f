"""Every config field, documented once. Experiment files start from here and change what differs.

An experiment file (`configs/NAME.py`) does

    from configs import base

    def get_config():
        config = base.get_config()
        config.task = base.task("dates", train_size=20_000)   # the task and its own parameters
        config.model.d_model = 256
        ...
        return base.lock(config)

and runs with `python train.py --config=configs/NAME.py --workdir=DIR [--config.a.b=v ...]`.
The task's and the model's parameters are documented with their dataclasses
(`tasks/dates.py` `DatesConfig`, `tasks/synthetic.py` `SyntheticConfig`,
`tasks/parallel_text.py` `ParallelTextConfig`, `tasks/catalog.py` `load_catalog`;
`models/transformer.py` `TransformerConfig`, `models/rnn.py` `RNNEncDecConfig`,
`RNNSearchConfig`, `LuongConfig`), so they are written down once there.
"""

from __future__ import annotations

import ml_collections


def task(name: str, **params) -> ml_collections.ConfigDict:
    """`config.task`: the task name (see `tasks.TASKS`, or a TFDS catalog name) and its parameters."""
    return ml_collections.ConfigDict({"name": name, **params})


def model(name: str, **fields) -> ml_collections.ConfigDict:
    """`config.model` for another family than the Transformer: its name and its own fields.

    The fields are those of the family's dataclass in `models.MODELS`; the ones
    not given keep that dataclass's defaults.
    """
    return ml_collections.ConfigDict({"name": name, **fields})


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    # Seed of parameters, dropout and data order: same seed, same run.
    config.seed = 0
    # Optimizer updates to train for.
    config.num_train_steps = 10_000
    # Global batch: rows per optimizer update, summed over all devices and processes
    # (with packing, a row holds several examples).
    config.batch_size = 64
    # Microbatches per update (gradient accumulation); batch_size must be divisible by it.
    config.grad_accum_steps = 1

    # Peak learning rate (reached at the end of warmup).
    config.learning_rate = 1e-3
    # Linear warmup steps of the schedule.
    config.warmup_steps = 1_000
    # After warmup: "rsqrt" (Vaswani et al. eq. 3: decay with 1/sqrt(step)), "cosine" (to 0 at
    # num_train_steps), or "constant".
    config.schedule = "rsqrt"
    # Adam moments; beta2=0.98 and eps=1e-9 as in Vaswani et al. section 5.3.
    config.adam_b1 = 0.9
    config.adam_b2 = 0.98
    config.adam_eps = 1e-9
    # Decoupled weight decay (AdamW); 0 = plain Adam.
    config.weight_decay = 0.0
    # Clip gradients to this global norm; 0 = no clipping.
    config.grad_clip_norm = 0.0
    # Label smoothing epsilon (Vaswani et al. section 5.4 use 0.1).
    config.label_smoothing = 0.1

    # Steps between log lines / metrics.jsonl training rows.
    config.log_every_steps = 50
    # Steps between evaluations on the dev split (and at the end of training).
    config.eval_every_steps = 1_000
    # Steps between checkpoints (and at the end, and on SIGTERM/SIGINT).
    config.checkpoint_every_steps = 1_000
    # The most recent checkpoints kept (the best one is kept besides).
    config.keep_checkpoints = 3
    # Eval metric that picks the best checkpoint, and whether larger is better.
    config.best_metric = "loss"
    config.best_metric_larger_is_better = False
    # --mode=eval/predict: the step to restore; -1 = the latest, or the best with restore_best.
    config.restore_step = -1
    config.restore_best = False
    # Examples of the split decoded at each evaluation for the task metric (0 = all).
    config.eval_decode_examples = 0
    # Split that --mode=eval/predict evaluates and decodes.
    config.eval_split = "test"
    # --mode=eval/predict: also evaluate the mean parameters of the last K checkpoints
    # (Vaswani et al. average the last 5 or 20); 0 or 1 = no averaging.
    config.average_last = 0
    # --mode=predict: width, in source tokens, of the length buckets of the per-length scores.
    config.length_bucket_width = 10
    # Dev examples whose attention is drawn at each evaluation (attention/step_<N>/); 0 = none.
    config.visualize_examples = 3
    # Draw self-attention too (encoder and decoder), not only encoder-decoder attention.
    config.visualize_self_attention = False

    # Where built datasets are cached (created if missing; relative to the working directory).
    config.data_dir = "data/tfds"
    # The task: see task() above.
    config.task = task("dates")

    config.tokenizer = ml_collections.ConfigDict()
    # "char" or "sentencepiece".
    config.tokenizer.kind = "char"
    # SentencePiece vocabulary size and model ("unigram" or "bpe").
    config.tokenizer.vocab_size = 8000
    config.tokenizer.model_type = "unigram"
    # One vocabulary for source and target.
    config.tokenizer.shared = True
    # Characters of the train split the tokenizer is trained on.
    config.tokenizer.max_corpus_chars = 10_000_000

    config.data = ml_collections.ConfigDict()
    # Token limits (eos included): longer training examples are dropped or trimmed.
    config.data.max_source_length = 64
    config.data.max_target_length = 64
    # "drop" or "trim" training examples over the limits (eval examples are always trimmed).
    config.data.length_policy = "drop"
    # "pack" several examples into rows of max lengths, or "bucket" by length and pad.
    config.data.batching = "bucket"
    # Padded lengths of the "bucket" batching.
    config.data.bucket_boundaries = (8, 16, 32, 64, 128, 256, 512)
    # Grain reader threads, and batches prepared ahead in a background thread.
    config.data.num_threads = 2
    config.data.prefetch_batches = 4

    # The model: "name" picks it from models.MODELS; the other fields are its dataclass's
    # (models/transformer.py TransformerConfig for "transformer"; models/rnn.py for the recurrent
    # families, set with model() above). Vocabulary sizes and the
    # special token ids come from the tokenizer.
    config.model = ml_collections.ConfigDict()
    config.model.name = "transformer"
    config.model.d_model = 128
    config.model.num_heads = 4
    config.model.num_encoder_layers = 2
    config.model.num_decoder_layers = 2
    config.model.d_ff = 512
    config.model.dropout_rate = 0.1
    config.model.attention_dropout_rate = 0.0
    config.model.relu_dropout_rate = 0.0
    config.model.pre_layer_norm = False
    config.model.share_embeddings = True
    config.model.tie_output = True
    config.model.positional = "sinusoidal"
    config.model.max_length = 512
    config.model.score = "scaled_dot"
    config.model.use_bias = True
    # "float32" or "bfloat16" activations (parameters and softmax stay float32).
    config.model.dtype = "float32"

    config.decode = ml_collections.ConfigDict()
    # Beam width; 1 = greedy search.
    config.decode.beam_size = 1
    # Length penalty alpha of Wu et al. (2016); 0 = none.
    config.decode.length_penalty = 0.6
    # Output length limit: source length + this offset.
    config.decode.max_length_offset = 50

    # Several processes: the coordinator "host:port", the number of processes and this one's
    # id. Empty/-1 = single process, unless the environment names a coordinator (then
    # jax.distributed.initialize() reads it from there).
    config.coordinator_address = ""
    config.num_processes = -1
    config.process_id = -1
    return config


def lock(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Locks the field set, so a misspelt `--config.x` override fails at once."""
    config.lock()
    return config


def set_field(config: ml_collections.ConfigDict, dotted_name: str, value) -> None:
    """`set_field(config, "model.d_model", 256)`: what `--config.model.d_model=256` does, from code."""
    *parents, leaf = dotted_name.split(".")
    target = config
    for parent in parents:
        target = target[parent]
    target[leaf] = value
