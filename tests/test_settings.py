"""Every config override is checked before anything is read or written: fuzzed overrides (wrong
types, zero and negative sizes, inconsistent values, empty strings, huge numbers, unknown names)
either stop with a `ConfigError` naming the field, with the workdir not even created, or give a
config whose model builds."""

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models
from configs import base
from engine import training_loop
from helpers.tiny import tiny_config, xla_flags
from run_setup import preflight
from run_setup.cluster import make_mesh
from run_setup.compatibility import flatten
from run_setup.run import build_model
from run_setup.settings import parse
from tasks import vocabularies
from utils.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# joining a cluster is not a value check
MULTI_PROCESS_FIELDS = ("coordinator_address", "num_processes", "process_id")


def fields_of(config) -> dict:
    """`{"model.d_model": 16, ...}`: every overridable field of `config` with its value."""
    return {k: v for k, v in flatten(config.to_dict()).items() if k not in MULTI_PROCESS_FIELDS}


TINY = tiny_config("unused")
FIELDS = fields_of(TINY)

INTS = st.sampled_from([0, -1, -7, 1, 2, 3, 5, 10**12, 2**31, -(2**40)]) | st.integers(-3, 70)
FLOATS = st.sampled_from([0.0, -1.0, 0.5, 1.0, 1.5, 1e300, 1e-300, math.nan, math.inf, -math.inf]) | st.floats(-2, 2)
STRINGS = st.sampled_from(["", " ", "nonsense", "float16", "test", "x" * 300, "-1"])
# unparsable for many types
WRONG = st.sampled_from(["abc", "1.5", "()", "None", "[]", "True"])


def literal(value) -> str:
    """The command-line text of `value` (`--config.a.b=<text>`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        return "(" + ",".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


@st.composite
def overrides(draw) -> tuple[str, str]:
    """A field (or a misspelt one) and the text of a value that may not fit it."""
    name = draw(st.sampled_from(sorted(FIELDS)) | st.just("model.d_modle") | st.just("nonexistent"))
    default = FIELDS.get(name, 0)
    if isinstance(default, bool):
        kinds = st.booleans().map(str) | WRONG
    elif isinstance(default, int):
        kinds = INTS.map(str) | WRONG
    elif isinstance(default, float):
        kinds = FLOATS.map(literal) | WRONG
    elif isinstance(default, tuple):
        kinds = st.lists(INTS, max_size=3).map(lambda v: literal(tuple(v))) | WRONG
    else:
        kinds = STRINGS | WRONG
    return name, draw(kinds)


def checked(name: str, text: str):
    """The tiny config with `--config.<name>=<text>`, checked as a run checks it (on 8 devices)."""
    config = base.load(TINY, [f"--config.{name}={text}"])
    preflight.check(parse(config), make_mesh())
    return config


# `checked` refuses on 8 devices; the run must see the same 8
@pytest.mark.all_devices
@settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(override=overrides())
def test_fuzzed_overrides_are_refused_by_name_before_the_workdir_exists_or_build(override, tmp_path):
    name, text = override
    try:
        config = checked(name, text)
    except ConfigError as error:
        assert name in str(error), f"--config.{name}={text}: the message does not name the field: {error}"
        workdir = tmp_path / f"w{abs(hash(override))}"
        # the run itself stops the same way, before creating its workdir
        with pytest.raises(ConfigError):
            training_loop.train_and_evaluate(parse(base.load(TINY, [f"--config.{name}={text}"])), workdir)
        assert not workdir.exists()
        return
    tokens = vocabularies.Tokenizers(*[vocabularies.CharTokenizer("abc")] * 2)
    shallow = base.load(
        config, [f"--config.model.{k}=2" for k, v in config.model.items() if k.endswith("layers") and v > 2]
    )
    # an accepted config builds (deeper stacks repeat the layers)
    abstract = nnx.eval_shape(lambda: build_model(parse(shallow), tokens))
    assert jax.tree.leaves(nnx.state(abstract, nnx.Param))


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("model.d_model", "0", "model.d_model must be positive, got 0"),
        ("model.num_heads", "3", "model.d_model 16 is not divisible by model.num_heads 3"),
        ("model.d_ff", str(2**31 - 2), "model transformer has .* parameters"),
        ("model.num_encoder_layers", str(10**6), "model.num_encoder_layers must be at most 1000"),
        ("batch_size", str(2**30), "batch_size 1073741824 .* output logits alone need"),
        ("learning_rate", "nan", "learning_rate must be a finite number"),
        ("schedule", "linear", "schedule must be one of rsqrt, cosine, constant"),
        ("task.train_size", "0", "task.train_size must be at least 1"),
        ("decode.temperature", "0.0", "decode.temperature must be positive and finite"),
        ("eval_split", "validation", "eval_split must be one of train, dev, test"),
        ("keep_checkpoints", "0", "keep_checkpoints must be at least 1"),
        ("data.bucket_boundaries", "abc", r"data.bucket_boundaries must be a tuple of ints like \(8, 16"),
        ("data.bucket_boundaries", "(0, 8)", "data.bucket_boundaries must be increasing positive lengths"),
    ],
)
def test_values_that_cannot_work_are_named(name, text, message):
    with pytest.raises(ConfigError, match=message):
        checked(name, text)


def test_a_bad_value_on_the_command_line_is_one_line_exit_code_2_and_no_workdir(tmp_path):
    workdir = tmp_path / "run"
    # the second value comes from a --flagfile, among absl's own flags
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text(f"--workdir={workdir}\n--config.model.num_heads=3\n")
    for flags, message in (
        (["--config.model.d_model=0"], "model.d_model must be"),
        ([f"--flagfile={flagfile}"], "is not divisible by model.num_heads 3"),
    ):
        result = subprocess.run(
            [sys.executable, str(PROJECT_ROOT / "train.py"), f"--workdir={workdir}", *flags],
            cwd=PROJECT_ROOT,
            env={**os.environ, "XLA_FLAGS": xla_flags(1)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
        assert not workdir.exists()


@pytest.mark.parametrize(
    "name, fields",
    [
        ("transformer", dict(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=3, num_decoder_layers=2)),
        ("luong", dict(embed_dim=8, hidden_dim=16, num_encoder_layers=3, num_decoder_layers=3)),
        ("lstmn", dict(embed_dim=8, hidden_dim=16, attention_dim=8, num_encoder_layers=2, num_decoder_layers=3)),
        (
            "rnnsearch",
            dict(embed_dim=8, hidden_dim=16, attention_dim=8, maxout_dim=4, num_encoder_layers=2, num_decoder_layers=1),
        ),
    ],
)
def test_parameter_count_from_two_layers_equals_the_built_models(name, fields):
    fields = dict(vocab_size=50, source_vocab_size=50, bos_id=1, pad_id=0, **fields)
    built = models.create_model(name, rngs=nnx.Rngs(0), **fields)
    assert preflight.parameter_count(name, fields) == sum(x.size for x in jax.tree.leaves(nnx.state(built, nnx.Param)))
