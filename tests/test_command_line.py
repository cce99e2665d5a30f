"""One flag syntax: `--flagfile=FILE` beside `--config.*` overrides, and `--config=FILE.py:ARG`."""

from pathlib import Path

import pytest
from absl import flags

from configs import base
from helpers.source_reading import imported
from run_setup import command_line
from utils.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("configs/wmt14_transformer.py:big", (Path("configs/wmt14_transformer.py"), "big")),
        ("configs/default.py", (Path("configs/default.py"), None)),
        # a colon in a folder's name is no argument
        ("/a:b/c.py", (Path("/a:b/c.py"), None)),
        ("c.py:", (Path("c.py"), "")),
    ],
)
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
    assert overrides == [
        "--config.batch_size=4",
        "--config.learning_rate=0.5",
        "--config.seed=3",
        "--config.batch_size=8",
        "--config.batch_size=16",
    ]
    config = base.load(PROJECT_ROOT / "configs" / "default.py", overrides)
    # the last one given wins
    assert (config.batch_size, config.learning_rate, config.seed) == (16, 0.5, 3)


def test_a_missing_flagfile_is_a_flags_error(tmp_path):
    with pytest.raises(flags.Error, match="nope.txt"):
        command_line.split_overrides(["train.py", f"--flagfile={tmp_path / 'nope.txt'}"], flags.FlagValues())


def test_the_wmt14_config_takes_its_size_after_a_colon():
    path = PROJECT_ROOT / "configs" / "wmt14_transformer.py"
    big = base.load(f"{path}:big", ["--config.num_train_steps=7"])
    assert (big.model.d_model, big.model.num_heads, big.model.d_ff, big.average_last, big.num_train_steps) == (
        1024,
        16,
        4096,
        20,
        7,
    )
    base_size = base.load(f"{path}:base")
    assert (base_size.model.d_model, base_size.model.dropout_rate, base_size.average_last) == (512, 0.1, 5)
    # no argument: base
    assert base.load(path).to_dict() == base_size.to_dict()
    for name in set(base_size.to_dict()) - {
        "model",
        "num_train_steps",
        "learning_rate",
        "checkpoint_every_steps",
        "keep_checkpoints",
        "average_last",
    }:
        # big differs from base in its own fields alone
        assert big[name] == base_size[name], name
    with pytest.raises(ConfigError, match="wmt14_transformer.py:huge: the size must be one of base, big"):
        base.load(f"{path}:huge")


def test_a_scripts_own_flags_take_a_flagfile_and_refuse_a_wrong_flag_in_one_line(tmp_path, capsys):
    values = flags.FlagValues()
    flags.DEFINE_integer("batch", 8, "rows", flag_values=values)
    flags.DEFINE_bool("recurrent", False, "a switch", flag_values=values)
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text("--batch=3\n--config.model.d_model=32\n")
    argv = ["bench.py", f"--flagfile={flagfile}", "--recurrent", "--config.seed=1"]
    assert command_line.parse(values, argv, "doc", overrides=True) == ["--config.model.d_model=32", "--config.seed=1"]
    assert (values.batch, values.recurrent) == (3, True)
    # argparse's spacing works too
    command_line.parse(values, ["bench.py", "--batch", "5"], "doc")
    # a second parse starts from the defaults
    assert (values.batch, values.recurrent) == (5, False)
    # --config.* only where a script takes overrides
    for wrong in (["--batch=x"], ["--config.seed=1"], ["extra"]):
        with pytest.raises(SystemExit) as exit_:
            command_line.parse(values, ["bench.py", *wrong], "doc")
        assert exit_.value.code == 2
        error = capsys.readouterr().err
        assert error.startswith("bench.py: error: ") and error.count("\n") == 1, error


def test_every_script_parses_absl_flags():
    scripts = [PROJECT_ROOT / name for name in ("train.py", "sweep.py", "inference.py")] + sorted(
        (PROJECT_ROOT / "benchmarks").glob("*.py")
    )
    argparse_users = [path.name for path in scripts if "argparse" in imported(path)]
    assert not argparse_users
    mains = [path.name for path in scripts if "def main(" in path.read_text()]
    assert {"train.py", "sweep.py", "inference.py"} <= set(mains) and all(
        "absl" in imported(PROJECT_ROOT / "benchmarks" / name)
        for name in mains
        if name not in ("train.py", "sweep.py", "inference.py")
    )
