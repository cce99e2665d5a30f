"""benchmarks/step_variants.py's reading of a `--variant`; the step it prepares (`prepared_step`)."""

import pytest

from benchmarks import step_variants


def test_a_variant_splits_into_overrides_and_xla_options():
    overrides, options = step_variants.split_variant(
        "--config.grad_accum_steps=4 xla:xla_cpu_enable_fast_math=true xla:xla_cpu_prefer_vector_width=512 "
        "xla:xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED --config.model.dtype=bfloat16 "
        "xla:xla_cpu_use_xnnpack=False xla:some_ratio=1.5 xla:some_count=-1 xla:some_text=a=b"
    )
    assert overrides == ["--config.grad_accum_steps=4", "--config.model.dtype=bfloat16"]
    # booleans as booleans; everything else as written, for XLA to parse by the option's type
    assert options == {
        "xla_cpu_enable_fast_math": True,
        "xla_cpu_prefer_vector_width": "512",
        "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
        "xla_cpu_use_xnnpack": False,
        "some_ratio": "1.5",
        "some_count": "-1",
        "some_text": "a=b",
    }
    assert step_variants.split_variant("") == ([], {})
    for word in ("xla:", "xla:name", "xla:=1", "xla:name="):
        with pytest.raises(ValueError, match="xla:NAME=VALUE"):
            step_variants.split_variant(word)
    with pytest.raises(ValueError, match="xla_cpu_use_xnnpack given twice"):
        step_variants.split_variant("xla:xla_cpu_use_xnnpack=true xla:xla_cpu_use_xnnpack=false")


def test_the_prepared_steps_batches_let_go_of_grains_iterator_on_the_way_out(shared_data_dir, monkeypatch):
    """Held by a caller's variable until the interpreter's exit, grain's iterator ran its `__del__`
    after the modules it needs were torn down and printed a traceback: `prepared_step` closes it
    and drops it when its block ends."""
    import gc
    import weakref

    import input_pipeline
    from benchmarks.train_throughput import prepared_step
    from helpers.tiny import tiny_config

    train_dataset, iterators = input_pipeline.train_dataset, []

    def recorded(*args, **kwargs):
        data, info = train_dataset(*args, **kwargs)

        class Recorded:
            def __iter__(self):
                iterator = iter(data)
                iterators.append(weakref.ref(iterator))
                return iterator

        return Recorded(), info

    monkeypatch.setattr(input_pipeline, "train_dataset", recorded)
    with prepared_step(tiny_config(shared_data_dir)) as (_, _, _, batches):
        assert next(batches)["inputs"].shape[0] == 16
        (iterator,) = iterators
        assert iterator() is not None
    gc.collect()
    assert iterator() is None
    with pytest.raises(StopIteration):
        next(batches)
