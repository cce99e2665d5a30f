"""The trainer: schedules, data parallelism, checkpoints, resume after SIGKILL, eval, bad configs, NaN."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import inference
import train
from configs import base
from engine import evaluation, exported_step, training_loop
from helpers.subprocess_runs import final_state, metric_rows
from helpers.tiny import tiny_config
from input_pipeline import train_dataset
from run_setup.run import prepare_run
from run_setup.settings import parse
from utils import allocator
from utils.errors import NonFiniteLoss, UserError

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def copy_with_a_damaged_checkpoint(workdir: Path, tmp_path: Path, step: int) -> Path:
    """A copy of a run folder whose checkpoint at `step` has every state file overwritten."""
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    for path in (copy / "checkpoints" / str(step) / "state").rglob("*"):
        if path.is_file():
            path.write_bytes(b"\x00garbage")
    return copy


# ---------------------------------------------------------------- pure parts


def test_rsqrt_schedule_is_the_papers_formula():
    config = base.get_config()
    config.update(learning_rate=512**-0.5 * 4000**-0.5, warmup_steps=4000, schedule="rsqrt")
    schedule = training_loop.learning_rate_schedule(parse(config).optimization)
    # the paper counts steps from 1
    for step_number in (1, 100, 4000, 9000, 100_000):
        paper = 512**-0.5 * min(step_number**-0.5, step_number * 4000**-1.5)
        assert abs(float(schedule(step_number - 1)) / paper - 1) < 1e-5


def test_cosine_and_constant_schedules():
    config = base.get_config()
    config.update(learning_rate=1.0, warmup_steps=10, num_train_steps=110, schedule="cosine")
    schedule = training_loop.learning_rate_schedule(parse(config).optimization)
    assert float(schedule(5)) == pytest.approx(0.5)
    # halfway through the cosine
    assert float(schedule(60)) == pytest.approx(0.5, abs=1e-6)
    assert float(schedule(110)) == pytest.approx(0.0, abs=1e-6)
    config.schedule = "constant"
    assert float(training_loop.learning_rate_schedule(parse(config).optimization)(50)) == 1.0
    config.schedule = "linear"
    with pytest.raises(ValueError, match="schedule must be"):
        training_loop.learning_rate_schedule(parse(config).optimization)


# ----------------------------------------------------------- data parallelism


def first_step(run, batch):
    """One train step of `run` from its initial state on `batch`."""
    tx = training_loop.make_optimizer(run.settings.optimization)
    state = training_loop.initial_state(run, tx)
    return training_loop.compile_train_step(run, tx, state)(state, run.global_batch(batch))


@pytest.mark.all_devices
def test_eight_devices_equal_one_device(shared_data_dir, tmp_path):
    assert jax.device_count() == 8
    config = tiny_config(shared_data_dir, batch_size=32)
    run8 = prepare_run(parse(config), tmp_path / "eight")
    run1 = prepare_run(parse(config), tmp_path / "one", devices=jax.devices()[:1])
    batch = next(iter(train_dataset(run8.task, run8.tokens, run8.settings.data, run8.settings.source)[0]))
    state8, metrics8 = first_step(run8, batch)
    state1, metrics1 = first_step(run1, batch)
    # replicated over 8
    assert all(len(p.sharding.device_set) == 8 for p in jax.tree.leaves(state8["params"]))
    np.testing.assert_allclose(metrics8["loss"], metrics1["loss"], rtol=1e-6)
    for p8, p1 in zip(jax.tree.leaves(state8["params"]), jax.tree.leaves(state1["params"])):
        np.testing.assert_allclose(np.asarray(p8), np.asarray(p1), rtol=1e-6, atol=1e-6)


def test_gradient_accumulation_equals_one_big_batch(shared_data_dir, tmp_path):
    """One microbatch at a time, and three an iteration of a loop of four (one whole iteration of
    three side by side, then the one left over)."""

    def run_of(name, **fields):
        config = tiny_config(shared_data_dir, batch_size=32, **fields, **{"model.dropout_rate": 0.0})
        return prepare_run(parse(config), tmp_path / name)

    whole = run_of("whole")
    batch = next(iter(train_dataset(whole.task, whole.tokens, whole.settings.data, whole.settings.source)[0]))
    state_a, metrics_a = first_step(whole, batch)
    for accumulate, unroll in ((2, 1), (4, 3)):
        split = run_of(f"{accumulate}_{unroll}", grad_accum_steps=accumulate, grad_accum_unroll=unroll)
        state_b, metrics_b = first_step(split, batch)
        np.testing.assert_allclose(metrics_a["loss"], metrics_b["loss"], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(state_a["params"]), jax.tree.leaves(state_b["params"]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ whole runs


def test_run_writes_its_outputs(finished_run):
    config, workdir, final = finished_run
    assert json.loads((workdir / "config.json").read_text())["model"]["d_model"] == 16
    rows = metric_rows(workdir)
    assert [r["step"] for r in rows if r["split"] == "train"] == [5, 10, 15, 20]
    assert [r["step"] for r in rows if r["split"] == "dev"] == [10, 20]
    assert {"loss", "token_accuracy", "perplexity", "exact_match"} <= set(final["test"])
    assert json.loads((workdir / "eval" / "step_20.json").read_text())["test"] == final["test"]
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [10, 20]
    assert any((workdir / "tensorboard").iterdir())
    # attention pictures of 3 dev examples at each evaluation
    for step in (10, 20):
        pictures = workdir / "attention" / f"step_{step}"
        assert sorted(p.name for p in pictures.glob("*.npz")) == ["example_0.npz", "example_1.npz", "example_2.npz"]
        assert len(list(pictures.glob("example_*_decoder_layers_0_cross_attention.png"))) == 3
    per_module = {k: v for k, v in final["dev"].items() if k.startswith("alignment_accuracy/")}
    # cross-attention only
    assert set(per_module) == {"alignment_accuracy/decoder_layers/0/cross_attention"}
    assert final["dev"]["alignment_accuracy"] == pytest.approx(np.mean(list(per_module.values())))


def test_predict_writes_hypotheses_and_scores_by_length(finished_run, tmp_path):
    config, workdir, final = finished_run
    path = evaluation.predict(parse(config), workdir)
    rows = path.read_text().splitlines()
    assert path.name == "step_20.tsv" and rows[0] == "source\treference\thypothesis" and len(rows) == 25
    results = json.loads((workdir / "eval" / "step_20.json").read_text())["test"]
    assert sum(bucket["examples"] for bucket in results["by_source_length"].values()) == 24
    assert results["exact_match"] == final["test"]["exact_match"]
    lines = tmp_path / "mine.txt"
    lines.write_text("3 March 2021\n\n12/24/99\n")
    path = inference.translate_file(parse(config), workdir, str(lines))
    rows = path.read_text().splitlines()
    assert path.name == "step_20_mine.tsv" and [r.split("\t")[0] for r in rows[1:]] == ["3 March 2021", "12/24/99"]


def test_average_of_the_last_checkpoints(finished_run):
    config, workdir, _ = finished_run
    run = prepare_run(parse(config), workdir)
    steps, averaged = run.averaged_params(2, 20)
    assert steps == [10, 20]
    states = [run.restore_params(s)[1] for s in steps]
    for mean, a, b in zip(jax.tree.leaves(averaged), *(jax.tree.leaves(p) for p in states)):
        np.testing.assert_allclose(np.asarray(mean), (np.asarray(a) + np.asarray(b)) / 2, rtol=1e-6)
    config = tiny_config(config.data_dir, average_last=2)
    outcome = evaluation.evaluate(parse(config), workdir)
    assert set(outcome) == {"test", "test_average_last_2"}


def test_inference_command_draws_a_sentence(finished_run, capsys):
    _, workdir, _ = finished_run
    assert inference.main(["--workdir", str(workdir), "--text", "3 March 2021"]) == 0
    assert "pictures and weights" in capsys.readouterr().out
    assert (workdir / "attention" / "text" / "step_20.npz").exists()
    assert list((workdir / "attention" / "text").glob("step_20_decoder_layers_0_cross_attention.png"))


def test_eval_mode_reproduces_the_final_eval(finished_run, caplog):
    config, workdir, final = finished_run
    with caplog.at_level(logging.INFO):
        results = evaluation.evaluate(parse(config), workdir)
    assert results == final["test"]
    # the page rewritten, with the eval's row
    assert "test (eval mode)" in (workdir / "report.html").read_text()
    # the decoding's progress (plain lines: no terminal)
    logged = [record.getMessage() for record in caplog.records]
    assert "evaluating test: started (24 examples)" in logged and any(
        m.startswith("evaluating test: done, 24 examples in ") for m in logged
    )


def test_corrupted_latest_checkpoint_falls_back_with_a_warning(finished_run, tmp_path, caplog):
    config, workdir, _ = finished_run
    copy = copy_with_a_damaged_checkpoint(workdir, tmp_path, step=20)
    run = prepare_run(parse(config), copy)
    step, _ = run.restore_params()
    assert step == 10
    assert "checkpoint at step 20" in caplog.text and "unreadable" in caplog.text
    assert "fell back to the checkpoint at step 10" in caplog.text


@pytest.mark.slow
def test_resuming_past_an_unreadable_checkpoint_keeps_it_aside(finished_run, tmp_path):
    config, workdir, _ = finished_run
    copy = copy_with_a_damaged_checkpoint(workdir, tmp_path, step=20)
    training_loop.train_and_evaluate(parse(tiny_config(config.data_dir, num_train_steps=30)), copy)
    names = sorted(p.name for p in (copy / "checkpoints").iterdir() if not p.name.startswith("."))
    # saved again, the bad one kept aside
    assert "20.unreadable" in names and {"20", "30"} <= set(names)
    assert [r["step"] for r in metric_rows(copy) if r["split"] == "train"] == [5, 10, 15, 20, 25, 30]


def test_a_run_compiles_its_train_step_once(shared_data_dir, tmp_path, monkeypatch):
    """The step the loop runs is the exported one (the tests' compilation cache folder is set): one
    argument signature, compiled once."""
    steps = []
    cached = exported_step.cached
    monkeypatch.setattr(exported_step, "cached", lambda *args: steps.append(cached(*args)) or steps[-1])
    training_loop.train_and_evaluate(
        parse(tiny_config(shared_data_dir, num_train_steps=12, eval_every_steps=12, checkpoint_every_steps=6)), tmp_path
    )
    [step] = steps
    assert isinstance(step, exported_step.ExportedStep)
    # no second compilation at step 1 or after a save
    assert [call._cache_size() for call in step.calls.values()] == [1]


def test_the_train_steps_buffer_size_is_kept_and_the_next_same_run_touches_that_much_ahead(
    shared_data_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(training_loop, "step_buffers_memo", lambda: tmp_path / "step_buffers.json")
    touched = []
    monkeypatch.setattr(allocator, "touch_huge_pages", lambda size: touched.append(size) or (lambda: None))
    fields = dict(num_train_steps=2, eval_every_steps=2, checkpoint_every_steps=2)
    settings = parse(tiny_config(shared_data_dir, **fields))
    training_loop.train_and_evaluate(settings, tmp_path / "first")
    size = training_loop.remembered_step_buffer(settings)
    # nothing known before the first run
    assert size > 0 and touched == [0]
    # the next run touches that much as it starts, and gives the pages back whatever happens next
    released = []
    monkeypatch.setattr(
        allocator, "touch_huge_pages", lambda size: touched.append(size) or (lambda: released.append(size))
    )
    monkeypatch.setattr(training_loop, "prepare_run", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        training_loop.train_and_evaluate(settings, tmp_path / "second")
    assert touched == [0, size] and released == [size]
    # other settings: nothing known
    assert training_loop.remembered_step_buffer(parse(tiny_config(shared_data_dir, seed=1, **fields))) == 0


PERSISTENT_CACHE_PROBE = """
import warnings
import train; train.set_up_process()
import jax, jax.numpy as jnp
warnings.filterwarnings("error", message=".*persistent compilation cache")  # unreadable cache: only a warning in JAX
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
f = lambda x: jnp.tanh(x @ x.T).sum()
jax.jit(f)(jnp.ones((64, 64))).block_until_ready()
jax.clear_caches()
jax.jit(f)(jnp.ones((64, 64))).block_until_ready()
print(jax.config.jax_compilation_cache_max_size, len(hits))
"""


def test_a_process_set_up_like_train_py_reads_its_compilation_cache_back(tmp_path):
    """train.set_up_process() sets the cache folder, and keeps it under its size once at start-up:
    an old entry past the size (a sparse file: its size, not its blocks) goes, with its companion,
    and the programs the process writes are read back. (conftest's cache, set in the environment,
    is left out here: train.py's own set-up is under test.)"""
    cache = tmp_path / ".cache" / "attend" / "jax"
    cache.mkdir(parents=True)
    with open(cache / "old-cache", "wb") as old:
        old.truncate(train.COMPILATION_CACHE_BYTES + 1)
    (cache / "old-atime").write_bytes(b"t")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(HOME=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=str(PROJECT_ROOT))
    probe = subprocess.run(
        [sys.executable, "-c", PERSISTENT_CACHE_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    cap, hits = (int(word) for word in probe.stdout.split()[-2:])
    # the second compilation (at least) was a hit
    assert hits >= 1, probe.stdout + probe.stderr
    # JAX's own cap is off: it would list the folder at every program written
    assert cap == -1
    assert not (cache / "old-cache").exists() and not (cache / "old-atime").exists()
    assert any(cache.glob("*-cache"))


def test_best_checkpoint_is_kept_and_restorable(shared_data_dir, tmp_path, monkeypatch):
    """The tiny run's dev loss falls at every evaluation, which would make the best checkpoint the
    last; its dev losses at 10, 20, 30 and 40 are set to 3, 1, 2 and 2.5 here, so that the best (20)
    is kept beside the last (40) and restores."""
    evaluate_split, dev_losses = evaluation.evaluate_split, iter([3.0, 1.0, 2.0, 2.5])

    def with_set_dev_losses(evaluator, params, split, **kwargs):
        results, decoded = evaluate_split(evaluator, params, split, **kwargs)
        return ({**results, "loss": next(dev_losses)} if split == "dev" else results), decoded

    monkeypatch.setattr(evaluation, "evaluate_split", with_set_dev_losses)
    config = tiny_config(shared_data_dir, num_train_steps=40, keep_checkpoints=1, best_metric="loss")
    training_loop.train_and_evaluate(parse(config), tmp_path)
    assert {r["step"]: r["loss"] for r in metric_rows(tmp_path) if r["split"] == "dev"} == {
        10: 3.0,
        20: 1.0,
        30: 2.0,
        40: 2.5,
    }
    run = prepare_run(parse(config), tmp_path)
    assert run.checkpoints.best_step() == 20
    # the last one and the best one
    assert set(run.checkpoints.steps()) == {20, 40}
    assert int(final_state(config, tmp_path, 20)["step"]) == 20


def test_a_window_cut_by_a_stop_keeps_its_seconds_for_the_resumed_row(tmp_path):
    """The resumed run's first row counts the steps trained before the stop at the seconds they took:
    32 steps in 45.7 s, then 18 in 29.3 s, log 50 / 75 s, not 50 / 29.3 s (a speed 2.6 times too fast)."""
    values = {
        "loss": 2.0,
        "nll": 2.0,
        "token_accuracy": 0.5,
        "tokens": 100.0,
        "grad_norm": 1.0,
        "update_norm": 0.1,
        "param_norm": 9.0,
    }
    training_loop.keep_unfinished_window(tmp_path, 1032, [(step, values) for step in range(1001, 1033)], 45.7)
    kept, seconds = training_loop.unfinished_window(tmp_path, 1032)
    assert [step for step, _ in kept] == list(range(1001, 1033)) and seconds == 45.7
    row = training_loop.summarize_window(kept + [(step, values) for step in range(1033, 1051)], 1e-3, seconds + 29.3)
    assert row["steps_per_second"] == pytest.approx(50 / 75.0) and row["tokens_per_second"] == pytest.approx(
        5000 / 75.0
    )
    # resumed from another step: nothing kept
    assert training_loop.unfinished_window(tmp_path, 1000) == ([], 0.0)
    # a file without the seconds
    (tmp_path / training_loop.UNFINISHED_WINDOW).write_text('{"step": 1032, "window": []}')
    assert training_loop.unfinished_window(tmp_path, 1032) == ([], 0.0)


def test_curves_png_is_drawn_once_its_interval_has_passed_and_when_the_run_ends(tmp_path, monkeypatch):
    clock, drawn = [1000.0], []
    monkeypatch.setattr(training_loop.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(training_loop.pages, "draw_curves", drawn.append)
    curves = training_loop.CurvesPicture(tmp_path, enabled=True)
    assert not curves.due() and curves.due(final=True)
    clock[0] += training_loop.CURVES_EVERY_SECONDS - 1
    assert not curves.due()
    clock[0] += 1
    assert curves.due()
    # at an evaluation before the last: rows follow it
    curves.drawn()
    assert not curves.due()
    # the run stopped (early, by a signal or an error): drawn again
    curves.finish()
    assert drawn == [tmp_path]
    curves.finish()
    # nothing written since
    assert drawn == [tmp_path]
    last = training_loop.CurvesPicture(tmp_path, enabled=True)
    # the last step's evaluation drew it
    last.drawn(final=True)
    last.finish()
    assert drawn == [tmp_path]
    # another process than the chief, or curves_png=False
    off = training_loop.CurvesPicture(tmp_path, enabled=False)
    clock[0] += training_loop.CURVES_EVERY_SECONDS
    assert not off.due() and not off.due(final=True)
    off.finish()
    assert drawn == [tmp_path]


# ------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "flag,message",
    [
        ("--config.modle.d_model=8", "modle"),
        ("--config.batch_size=many", "batch_size"),
        ("--config.data.batching=zip", "data.batching must be one of"),
        ("--config.task.name=dtaes", "unknown task.name 'dtaes'"),
    ],
)
def test_bad_config_fails_with_a_message_naming_it(tmp_path, flag, message):
    """What train.py makes of its flags before it builds anything (`settings_for`) refuses each with a
    `UserError` naming the culprit, which train.py prints as one line, exit code 2, no traceback
    (tested through a process: test_settings.py, `test_a_bad_value_on_the_command_line_...`)."""
    with pytest.raises(UserError, match=re.escape(message)):
        train.settings_for("train", tmp_path, str(train.DEFAULT_CONFIG), [flag])


@pytest.mark.curves
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(shared_data_dir, tmp_path):
    training_loop.train_and_evaluate(parse(tiny_config(shared_data_dir, num_train_steps=10)), tmp_path)
    exploding = tiny_config(
        shared_data_dir,
        learning_rate=1e30,
        schedule="constant",
        num_train_steps=60,
        checkpoint_every_steps=5,
        eval_every_steps=1000,
    )
    drawn_before = (tmp_path / "curves.png").stat().st_mtime_ns
    with pytest.raises(NonFiniteLoss, match=r"loss is (nan|inf) at step 1[1-5]"):
        training_loop.train_and_evaluate(parse(exploding), tmp_path)
    # drawn again as the error ended the run
    assert (tmp_path / "curves.png").stat().st_mtime_ns > drawn_before
    run = prepare_run(parse(exploding), tmp_path)
    assert run.checkpoints.steps() == [10]
    _, params = run.restore_params()
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))


def test_a_second_run_on_a_workdir_is_refused_and_a_killed_runs_lock_is_taken_over(shared_data_dir, tmp_path):
    from utils.errors import WorkdirInUse
    from utils.files import WorkdirLock

    config = tiny_config(shared_data_dir, num_train_steps=2, eval_every_steps=2, checkpoint_every_steps=2)
    tmp_path.mkdir(exist_ok=True)
    # another run training there (another open file: flock refuses even this process)
    first = WorkdirLock.acquire(tmp_path)
    with pytest.raises(WorkdirInUse, match=f'in use by another run .*"pid": {os.getpid()}'):
        training_loop.train_and_evaluate(parse(config), tmp_path)
    # no tokenizer, checkpoints, metrics or log
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", ".lock.holder"]
    # as the kernel does when a run is killed; the holder file and its stale pid stay behind
    first.release()
    assert (tmp_path / ".lock.holder").read_text()
    training_loop.train_and_evaluate(parse(config), tmp_path)
    assert (tmp_path / "checkpoints" / "2").exists()
    # the finished run let go of it
    WorkdirLock.acquire(tmp_path).release()
