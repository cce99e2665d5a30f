"""One flag syntax: `--flagfile=FILE` beside `--config.*` overrides, and `--config=FILE.py:ARG`."""

from pathlib import Path

import pytest
from absl import flags

from run_setup import command_line
from configs import base
from errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("source, expected", [
    ("configs/wmt14_transformer.py:big", (Path("configs/wmt14_transformer.py"), "big")),
    ("configs/default.py", (Path("configs/default.py"), None)),
    ("/a:b/c.py", (Path("/a:b/c.py"), None)),  # a colon in a folder's name is no argument
    ("c.py:", (Path("c.py"), "")),
])  # fmt: skip
def test_split_config_argument(source, expected):
    assert base.split_config_argument(source) == expected


def test_flagfile_overrides_are_taken_in_order_with_the_command_lines(tmp_path):
    inner = tmp_path / "inner.txt"
    inner.write_text("--config.seed=3\n")
    outer = tmp_path / "outer.txt"
    outer.write_text(f"--workdir=runs/x\n--config.learning_rate=0.5\n--flagfile={inner}\n--config.batch_size=8\n")
    argv = ["train.py", "--config.batch_size=4", f"--flagfile={outer}", "--config.batch_size=16", "--mode=eval"]
    arguments, overrides = command_line.split_overrides(argv, flags.FlagValues())
    assert arguments == ["train.py", "--workdir=runs/x", "--mode=eval"]
    assert overrides == ["--config.batch_size=4", "--config.learning_rate=0.5", "--config.seed=3", "--config.batch_size=8",
                         "--config.batch_size=16"]  # fmt: skip
    config = base.load(PROJECT_ROOT / "configs" / "default.py", overrides)
    assert (config.batch_size, config.learning_rate, config.seed) == (16, 0.5, 3)  # the last one given wins


def test_a_missing_flagfile_is_a_flags_error(tmp_path):
    with pytest.raises(flags.Error, match="nope.txt"):
        command_line.split_overrides(["train.py", f"--flagfile={tmp_path / 'nope.txt'}"], flags.FlagValues())


def test_the_wmt14_config_takes_its_size_after_a_colon():
    path = PROJECT_ROOT / "configs" / "wmt14_transformer.py"
    big = base.load(f"{path}:big", ["--config.num_train_steps=7"])
    assert (big.model.d_model, big.model.num_heads, big.model.d_ff, big.average_last, big.num_train_steps) == (1024, 16, 4096, 20, 7)
    base_size = base.load(f"{path}:base")
    assert (base_size.model.d_model, base_size.model.dropout_rate, base_size.average_last) == (512, 0.1, 5)
    assert base.load(path).to_dict() == base_size.to_dict()  # no argument: base
    for name in set(base_size.to_dict()) - {"model", "num_train_steps", "learning_rate", "checkpoint_every_steps",
                                            "keep_checkpoints", "average_last"}:  # fmt: skip
        assert big[name] == base_size[name], name  # big differs from base in its own fields alone
    with pytest.raises(ConfigError, match="wmt14_transformer.py:huge: the size must be one of base, big"):
        base.load(f"{path}:huge")
