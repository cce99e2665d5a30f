"""Run folders and a sweep written by the code before its modules moved into folders (d8b2e78,
kept in tests/data/run_folders_before_the_move/): they evaluate, load, resume and are read as a
run folder of today's code is.

The run is 10 steps of the tiny Transformer on dates (tests/helpers/subprocess_runs.py's
`TINY_FLAGS`, with `visualize_examples=2`), the sweep a grid of two 5-step trials of it
(`sweep_file.py` beside them; their checkpoints left out, which a finished sweep does not read).
Both were made under the tests' XLA flags on one device, with `--config.data_dir=/tmp/fixture_data`,
the folder their config.json records (a resumed run must keep its task's fields, data_dir among
them)."""

import csv
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.storages.journal import JournalFileBackend

import inference
import train
from engine import evaluation
from helpers.subprocess_runs import PROJECT_ROOT, run_train_py
from helpers.tiny import xla_flags
from tools import compare_runs

BEFORE = Path(__file__).resolve().parent / "data" / "run_folders_before_the_move"
DATA_DIR = "/tmp/fixture_data"
RUN_FLAGS = [
    "--config.visualize_examples=2",
    "--config.eval_every_steps=10",
    "--config.checkpoint_every_steps=10",
]


@pytest.fixture
def old_run(tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(BEFORE / "run", copy)
    return copy


def test_an_old_run_folder_evaluates_to_its_own_final_scores(old_run):
    """--mode=eval's settings, as train.py makes them: the run's config.json with the command's
    evaluation fields."""
    run_settings = train.settings_for("eval", old_run, None, [f"--config.data_dir={DATA_DIR}"])
    results = evaluation.evaluate(run_settings, old_run)
    before = json.loads((BEFORE / "run" / "eval" / "step_10.json").read_text())["test"]
    for name in ("loss", "token_accuracy", "exact_match", "symbol_accuracy", "alignment_accuracy"):
        assert results[name] == pytest.approx(before[name], rel=1e-6), name


def test_a_model_without_the_runs_attention_biases_is_refused_its_checkpoint(old_run):
    """The old run trained with attention biases (the default then). A model built without them (today's
    default) would read every other parameter and pass over the biases; the restore names them instead,
    and the run's own settings restore."""
    import orbax.checkpoint as ocp

    from run_setup import checkpoints, settings
    from run_setup import run as run_module
    from utils.errors import CheckpointError

    saved = settings.read_run_settings(old_run).as_dict()
    saved["data_dir"] = DATA_DIR
    assert saved["model"]["use_bias"] is True
    step, _ = run_module.prepare_run(settings.parse(saved), old_run).restore_params()
    assert step == 10
    # the parameters' names read from Orbax's file are those of its metadata API
    state = old_run / "checkpoints" / "10" / "state"
    api = checkpoints.key_paths(ocp.PyTreeCheckpointer().metadata(state).item_metadata["params"])
    assert checkpoints.saved_parameter_paths(state) == api and len(api) == 40
    without = settings.parse({**saved, "model": {**saved["model"], "use_bias": False}})
    # one encoder and one decoder layer: three attentions, each with biases on its query, value and output
    biases = r"holds 9 parameter\(s\) this model has not, e\.g\. decoder_layers/0/cross_attention/out/bias/value"
    with pytest.raises(CheckpointError, match=biases):
        run_module.prepare_run(without, old_run).restore_params()


def test_an_old_run_folder_loads_and_translates_as_it_predicted(old_run):
    translator = inference.load(old_run)
    lines = (old_run / "predictions" / "step_10_test.tsv").read_text().splitlines()
    assert lines[0] == "source\treference\thypothesis"
    rows = [line.split("\t") for line in lines[1:]]
    sources, hypotheses = [row[0] for row in rows[:8]], [row[2] for row in rows[:8]]
    assert translator.translate(sources) == hypotheses


def test_todays_code_trains_the_old_run_again_and_resumes_it(old_run, tmp_path):
    """The same command run by today's code, with the dropout masks the old code drew (the run's
    config.json, made before the field existed, reads back with them) and the attention biases its
    Transformer had by default (today's has none), writes the same run as the old code
    did (metrics rows but timing, evaluations, predictions, every checkpoint array: the arrays to
    1e-5 of each array's largest, as the fixture was made on another machine, and XLA:CPU's kernels
    follow the CPU: a model 207 Xeon ends 10 steps up to 6e-7 of the largest apart from the
    fixture's, its rows and evaluations equal); and the old run, resumed to step 15 by the command
    without those fields, goes on from its checkpoint at step 10 with its rows up to there kept and
    its own masks and biases (`check_resume`)."""
    old_defaults = ["--config.model.dropout_masks=bernoulli", "--config.model.use_bias=true"]
    whole = run_train_py(tmp_path / "whole", DATA_DIR, *RUN_FLAGS, "--config.num_train_steps=10", *old_defaults)
    resumed = run_train_py(old_run, DATA_DIR, *RUN_FLAGS, "--config.num_train_steps=15")
    outputs = [process.communicate(timeout=300)[0] for process in (whole, resumed)]
    for process, output in zip((whole, resumed), outputs, strict=True):
        assert process.returncode == 0, output
    differ, same = compare_runs.differences(BEFORE / "run", tmp_path / "whole", rtol=1e-5)
    assert differ == [] and any(item.startswith("checkpoint 10") for item in same), same

    assert "resuming from the checkpoint at step 10" in (old_run / "log.txt").read_text()
    assert "model.dropout_masks: 'bernoulli', as the run began" in outputs[1]
    old_rows, resumed_rows = compare_runs.metric_rows(BEFORE / "run"), compare_runs.metric_rows(old_run)
    assert resumed_rows[: len(old_rows)] == old_rows
    assert [r["step"] for r in resumed_rows[len(old_rows) :] if r["split"] == "train"] == [15]
    assert (old_run / "checkpoints" / "15").is_dir() and (old_run / "eval" / "step_15.json").is_file()


def test_an_old_sweep_is_read_by_sweep_py_without_rerunning_its_trials(tmp_path):
    """Its study's name is its folder's, so the copy keeps the folder name `sweep`."""
    workdir = tmp_path / "sweep"
    shutil.copytree(BEFORE / "sweep", workdir)
    # what sweep.py writes from the study, gone: the run must write it again
    for written in ("results.csv", "results.md", "report.html", "objective_by_field.png"):
        (workdir / written).unlink()
    journal_before = (workdir / "study.journal").read_text()
    command = [
        sys.executable,
        str(PROJECT_ROOT / "sweep.py"),
        "--config=configs/default.py",
        f"--sweep={BEFORE / 'sweep_file.py'}",
        f"--workdir={workdir}",
    ]
    environment = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    finished = subprocess.run(command, cwd=PROJECT_ROOT, env=environment, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "2 trials: 2 complete" in finished.stdout
    # no trial ran again: the journal only gained the workers' "open the study" records (op code 0) and
    # the config the sweep began with, read from its first trial's config.json (a study user attribute, 2)
    journal = (workdir / "study.journal").read_text()
    assert journal.startswith(journal_before)
    added = [json.loads(line) for line in journal[len(journal_before) :].splitlines()]
    assert {record["op_code"] for record in added} <= {0, 2}
    began = optuna.load_study(
        study_name="sweep", storage=optuna.storages.JournalStorage(JournalFileBackend(str(workdir / "study.journal")))
    ).user_attrs["config"]
    assert began["model"]["name"] == "transformer" and began["model"]["use_bias"] is True
    assert not any((workdir / "trials" / name / "checkpoints").exists() for name in ("trial_0000", "trial_0001"))
    with open(workdir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["trial"] for row in rows] == ["1", "0"] and rows[0]["learning_rate"] == "0.003"
    values = [float(row["dev/token_accuracy"]) for row in rows]
    assert values == sorted(values, reverse=True) and np.isfinite(values).all()
    # the trials' own folders, where the copy has them now, not where the study recorded them
    assert [Path(row["workdir"]) for row in rows] == [workdir / "trials" / f"trial_000{row['trial']}" for row in rows]
    page = (workdir / "report.html").read_text()
    assert 'href="trials/trial_0000/report.html"' in page and "/work/ref/" not in page


def test_arrays_compare_bit_for_bit_or_to_a_tolerance_of_the_largest_entry():
    moments = np.array([1.0, 1e-6, 0.0], np.float32)
    # 1e-7 off at entries near 0: within 1e-5 of the largest entry (1.0), not of their own size
    nearby = moments + np.float32(1e-7)
    assert not compare_runs.arrays_equal(moments, nearby, rtol=0.0)
    assert compare_runs.arrays_equal(moments, nearby, rtol=1e-5)
    assert not compare_runs.arrays_equal(moments, moments + np.float32(3e-5), rtol=1e-5)
    assert compare_runs.arrays_equal(moments, moments.copy(), rtol=0.0)
    assert not compare_runs.arrays_equal(moments, moments[:2], rtol=1e-5)
    # counts and flags: equal or not, whatever the tolerance
    assert not compare_runs.arrays_equal(np.array([3]), np.array([4]), rtol=1.0)
    assert compare_runs.arrays_equal(np.array([True, False]), np.array([True, False]), rtol=1e-5)


def test_curve_gaps_are_the_largest_relative_gap_at_the_steps_both_runs_logged(tmp_path):
    """Hand-worked: loss gaps 0, 0.1 / 4 = 2.5% (step 20), 0.02 / 2 = 1% (step 30); accuracy 0.01 (at
    0: the absolute gap), 0, 0.05 / 0.5 = 10%; step 40 logged by one run only; the dev row and the
    timing column not compared."""
    rows = {
        "a": [(10, 5.0, 0.0), (20, 4.0, 0.5), (30, 2.0, 0.5), (40, 1.0, 0.6)],
        "b": [(10, 5.0, 0.01), (20, 4.1, 0.5), (30, 2.02, 0.55)],
    }
    for run, logged in rows.items():
        (tmp_path / run).mkdir()
        lines = [{"step": 0, "split": "data", "train_examples": 9}]
        lines += [
            {"step": step, "split": "train", "loss": loss, "token_accuracy": accuracy, "steps_per_second": step}
            for step, loss, accuracy in logged
        ]
        lines.append({"step": 30, "split": "dev", "loss": 7.0 if run == "a" else 9.0})
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    gaps = compare_runs.curve_gaps(tmp_path / "a", tmp_path / "b")
    assert set(gaps) == {"loss", "token_accuracy"}
    assert gaps["loss"][1:] == (20, 3) and gaps["loss"][0] == pytest.approx(0.025)
    assert gaps["token_accuracy"][1:] == (30, 3) and gaps["token_accuracy"][0] == pytest.approx(0.1)
    # a NaN in either run is the largest gap, not one that `max` drops
    assert compare_runs.relative_gap(2.0, float("nan")) == compare_runs.relative_gap(float("nan"), 2.0) == math.inf


def test_a_checkpoint_array_that_differs_is_named_and_read_on_any_devices(tmp_path):
    """`compare_runs.differences` reads the latest checkpoint of each run as NumPy arrays: one saved
    across this process's 8 devices is read by a process of one device (on its saved shardings it
    did not restore there) and without Orbax's warning that those shardings are unsafe elsewhere;
    equal trees are one `same` item, a changed entry names its array, a newer step says so."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    # device arrays, saved with their sharding, as a run saves its state: the kernel's rows over 8 devices
    rows = NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
    kernel = jax.device_put(jnp.arange(24, dtype=jnp.float32).reshape(8, 3), rows)
    state = {"params": {"kernel": kernel}, "step": jnp.int32(4)}

    def run_folder(name: str, step: int, tree: dict) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.jsonl").write_text('{"step": 4, "split": "train", "loss": 1.5}\n')
        ocp.PyTreeCheckpointer().save((folder / "checkpoints" / str(step) / "state").absolute(), tree)
        return folder

    first, copy = run_folder("first", 4, state), run_folder("copy", 4, state)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Sharding info not provided")
        assert compare_runs.differences(first, copy) == ([], ["metrics.jsonl: 1 and 1 rows", "checkpoint 4: 2 arrays"])
    one_device = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "tools" / "compare_runs.py"), str(first), str(copy)],
        env={**os.environ, "XLA_FLAGS": xla_flags(1)},
        capture_output=True,
        text=True,
    )
    assert one_device.returncode == 0 and "checkpoint 4: 2 arrays" in one_device.stdout, one_device.stderr
    # one entry 1e-3 off: 4e-5 of the array's largest (23)
    kernel = kernel + jnp.zeros((8, 3), jnp.float32).at[7, 2].set(1e-3)
    changed = run_folder("changed", 4, {"params": {"kernel": kernel}, "step": state["step"]})
    assert compare_runs.differences(first, changed)[0] == ["checkpoint 4: ['params']['kernel']"]
    assert compare_runs.differences(first, changed, rtol=1e-4)[0] == []
    assert compare_runs.differences(first, run_folder("later", 8, state))[0] == [
        "checkpoints: step 4 with 2 arrays, step 8 with 2 arrays"
    ]
