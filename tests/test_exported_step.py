"""engine/exported_step.py: the train step exported once, read back by the next run, and what its key holds.

A small step of the train step's form (a donated state dict, a batch dict, metrics) stands in for
the real one, which `test_training_loop.py` runs through the loop."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from engine import exported_step
from helpers.tiny import tiny_config
from run_setup.settings import parse

SETTINGS = parse(tiny_config("unused"))
REPLICATED = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def plain_step(state, batch):
    """An Adam-free update: `w <- w - 0.1 * x^T (x w)`, with the loss as the metric."""
    predictions = batch["x"] @ state["w"]
    new_state = {"step": state["step"] + 1, "w": state["w"] - 0.1 * batch["x"].T @ predictions}
    return new_state, {"loss": jnp.mean(predictions**2)}


def state_and_batch(rows: int = 4):
    state = {"step": jnp.zeros((), jnp.int32), "w": jnp.arange(6, dtype=jnp.float32).reshape(3, 2) / 10}
    return state, {"x": jnp.ones((rows, 3), jnp.float32)}


JITTED = jax.jit(plain_step, donate_argnums=0)


def run_twice(step):
    state, batch = state_and_batch()
    for _ in range(2):
        state, metrics = step(state, batch)
    return jax.tree.map(np.asarray, (state, metrics))


def test_the_exported_step_is_the_jitted_one_and_the_next_run_reads_it_back(tmp_path, monkeypatch):
    expected = run_twice(JITTED)
    first = exported_step.ExportedStep(JITTED, SETTINGS, REPLICATED, tmp_path)
    jax.tree.map(np.testing.assert_array_equal, run_twice(first), expected)
    assert len(list(tmp_path.iterdir())) == 1
    # the state is donated, as the jitted step donates it
    state, batch = state_and_batch()
    first(state, batch)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))

    # the next run: read back, not exported (nor traced) again
    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(export, "export", no_export)
    second = exported_step.ExportedStep(JITTED, SETTINGS, REPLICATED, tmp_path)
    jax.tree.map(np.testing.assert_array_equal, run_twice(second), expected)
    assert len(second.calls) == 1


def test_an_unreadable_export_is_made_again(tmp_path, caplog):
    exported_step.ExportedStep(JITTED, SETTINGS, REPLICATED, tmp_path)(*state_and_batch())
    [kept] = tmp_path.iterdir()
    kept.write_bytes(b"not a flatbuffer")
    again = exported_step.ExportedStep(JITTED, SETTINGS, REPLICATED, tmp_path)
    jax.tree.map(np.testing.assert_array_equal, run_twice(again), run_twice(JITTED))
    assert f"{kept} does not read back as an exported train step" in caplog.text
    assert kept.read_bytes() != b"not a flatbuffer"


def test_an_export_that_does_not_lower_is_removed_and_the_step_traced(tmp_path, caplog):
    """A file under the key of 4 rows holding the step exported for 5 (what a key that missed
    something would hold): lowering it fails, the file goes, the jitted step runs."""
    exported_step.ExportedStep(JITTED, SETTINGS, REPLICATED, tmp_path)(*state_and_batch(rows=5))
    [five_rows] = tmp_path.iterdir()
    four_rows = tmp_path / exported_step.export_key(SETTINGS, state_and_batch())
    five_rows.rename(four_rows)
    step = exported_step.ExportedStep(JITTED, SETTINGS, REPLICATED, tmp_path)
    state, batch = state_and_batch()
    step.lower(state, batch).compile()
    jax.tree.map(np.testing.assert_array_equal, run_twice(step), run_twice(JITTED))
    assert f"the exported train step {four_rows.name} does not lower" in caplog.text
    assert not four_rows.exists()


def test_a_step_that_cannot_be_exported_runs_jitted(tmp_path, caplog):
    """A host callback has no exported form: the jitted step runs, and nothing is written."""

    def with_callback(state, batch):
        jax.debug.callback(lambda loss: None, jnp.sum(batch["x"]))
        return plain_step(state, batch)

    caplog.set_level(logging.INFO)
    jitted = jax.jit(with_callback, donate_argnums=0)
    step = exported_step.ExportedStep(jitted, SETTINGS, REPLICATED, tmp_path)
    jax.tree.map(np.testing.assert_array_equal, run_twice(step), run_twice(JITTED))
    assert "the train step is not exported" in caplog.text and not list(tmp_path.iterdir())


def test_the_key_changes_with_the_code_settings_and_arguments(monkeypatch):
    arguments = state_and_batch()
    key = exported_step.export_key(SETTINGS, arguments)
    assert exported_step.export_key(SETTINGS, arguments) == key
    for changed in ({"model.dropout_rate": 0.2}, {"learning_rate": 0.1}, {"seed": 1}, {"sharding": "fsdp"}):
        assert exported_step.export_key(parse(tiny_config("unused", **changed)), arguments) != key, changed
    # what the step does not read: one export for runs that differ only there
    for unread in ({"eval_every_steps": 7}, {"checkpoint_every_steps": 3}, {"decode.beam_size": 2}):
        assert exported_step.export_key(parse(tiny_config("elsewhere", **unread)), arguments) == key, unread
    assert exported_step.export_key(SETTINGS, state_and_batch(rows=5)) != key
    # the same shapes under other names: another structure
    state, batch = arguments
    assert exported_step.export_key(SETTINGS, (state, {"y": batch["x"]})) != key
    monkeypatch.setattr(exported_step, "code_digest", lambda: "another code")
    assert exported_step.export_key(SETTINGS, arguments) != key


def test_the_code_digest_reads_the_steps_sources_only(tmp_path, monkeypatch):
    """The root's modules and its packages' but tests, benchmarks and tools, by path and bytes; not a
    folder without `__init__.py` (a run folder, a virtual environment)."""
    for name in (
        "models/__init__.py",
        "models/a.py",
        "train.py",
        "tests/__init__.py",
        "tests/test_a.py",
        "benchmarks/__init__.py",
        "benchmarks/b.py",
        "runs/c.py",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(exported_step, "PROJECT_ROOT", tmp_path)

    def digest():
        exported_step.code_digest.cache_clear()
        return exported_step.code_digest()

    before = digest()
    for unread in ("tests/test_a.py", "benchmarks/b.py", "runs/c.py"):
        (tmp_path / unread).write_text("x = 2\n")
    assert digest() == before
    for read in ("models/a.py", "train.py"):
        (tmp_path / read).write_text(f"x = '{read}'\n")
        assert digest() != before
        before = digest()
    exported_step.code_digest.cache_clear()


@pytest.mark.parametrize("count", [1, 3])
def test_only_the_most_recently_used_exports_are_kept(tmp_path, count):
    for age, name in enumerate("abcd"):
        (tmp_path / name).write_text(name)
        os.utime(tmp_path / name, (1000 + age, 1000 + age))
    exported_step.keep_newest(tmp_path, count)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted("abcd"[-count:])
