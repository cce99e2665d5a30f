"""A tiny config for tests that run the trainer, and the XLA flags of every test process
(importable without side effects)."""


def xla_flags(devices: int) -> str:
    """`devices` forced host devices, and XLA's CPU compiler set for the tests' thousands of tiny
    programs, which take longer to compile than to run: LLVM's optimisation off, the LLVM IR
    emitters instead of the MLIR fusion emitters, and one codegen split (docs/performance.md,
    "The test suite", measures each). The numbers may differ from XLA's defaults' by rounding;
    tests compare bit for bit only runs made under these same flags. Training, evaluation and
    the benchmarks compile under XLA's defaults."""
    return (
        "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
        "--xla_cpu_parallel_codegen_split_count=1 "
        f"--xla_force_host_platform_device_count={devices}"
    )


def tiny_config(data_dir, **overrides):
    """configs/default.py shrunk to seconds: a 1+1-layer Transformer on 600 dates."""
    from configs import default

    config = default.get_config()
    config.data_dir = str(data_dir)
    config.task.update(train_size=600, dev_size=24, test_size=24)
    config.model.update(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1)
    config.update(
        batch_size=16,
        num_train_steps=20,
        eval_every_steps=10,
        checkpoint_every_steps=10,
        log_every_steps=5,
        warmup_steps=5,
        schedule="rsqrt",
        visualize_examples=0,
    )
    return locked_with(config, overrides)


def locked_with(config, overrides: dict):
    """`config` with each `{"a.b": value}` of `overrides` set as `--config.a.b=value` sets it, locked."""
    from configs import base

    for dotted_name, value in overrides.items():
        base.set_field(config, dotted_name, value)
    config.lock()
    return config


def first_devices_mesh(count: int):
    """A stand-in for `run_setup.run.make_mesh` that takes the first `count` devices where the real
    one takes them all (`devices=None`)."""

    def make_mesh(devices=None, *args, **kwargs):
        import jax

        from run_setup import cluster

        return cluster.make_mesh(jax.devices()[:count] if devices is None else devices, *args, **kwargs)

    return make_mesh


def two_process_config(data_dir, steps: int, sharding: str = "replicated", **overrides):
    """tests/helpers/two_process_worker.py's config: `tiny_config` with a log row every 4 steps, saving and
    evaluating only at the end, no curves.png (as `TINY_FLAGS`); no dropout under a sharded mode (its
    runs are compared with one process's, to rounding)."""
    dropout = {} if sharding == "replicated" else {"model.dropout_rate": 0.0}
    return tiny_config(
        data_dir,
        num_train_steps=steps,
        log_every_steps=4,
        checkpoint_every_steps=1000,
        eval_every_steps=1000,
        sharding=sharding,
        curves_png=False,
        **dropout,
        **overrides,
    )


# The captioner shrunk to seconds (tests of captioning through the trainer).
TINY_CAPTIONER = dict(conv_widths=(8, 8), pools=2, embed_dim=8, hidden_dim=16, attention_dim=8)


def captioning_config(data_dir, attention="soft", **overrides):
    """configs/captioner_digit_strips.py shrunk to seconds: the tiny captioner on 96 digit strips."""
    from configs import base

    config = base.load("configs/captioner_digit_strips.py")
    config.unlock()
    config.data_dir = str(data_dir)
    config.task.update(train_size=96, dev_size=8, test_size=8)
    config.model.update(attention=attention, **TINY_CAPTIONER)
    config.update(
        batch_size=8,
        num_train_steps=4,
        eval_every_steps=4,
        checkpoint_every_steps=4,
        log_every_steps=2,
        warmup_steps=2,
        visualize_examples=1,
    )
    return locked_with(config, overrides)
