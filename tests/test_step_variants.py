"""benchmarks/step_variants.py's reading of a `--variant`."""

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
