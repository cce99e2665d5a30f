"""Faults injected into runs (README "What survives what"): damaged checkpoints, a failed checkpoint
write, SIGKILL at chosen points, several processes and their cluster."""

import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.path import atomicity

from engine import training_loop
from helpers.subprocess_runs import (
    FAULT_WORKER,
    WHOLE_RUN_FLAGS,
    assert_same_final_state,
    final_state,
    metric_rows,
    run_train_py,
)
from helpers.tiny import first_devices_mesh, tiny_config, two_process_config, xla_flags
from run_setup import checkpoints, cluster
from run_setup import run as run_module
from run_setup.run import prepare_run
from run_setup.settings import parse
from tools import compare_runs
from utils import files
from utils.errors import CheckpointError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
TWO_PROCESS_WORKER = PROJECT_ROOT / "tests" / "helpers" / "two_process_worker.py"


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def largest_file(folder: Path) -> Path:
    """The largest data file of an Orbax folder (not its `_METADATA`-like JSON, which a flipped bit makes
    unreadable)."""
    return max(
        (p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("_")), key=lambda p: p.stat().st_size
    )


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): files.sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_flipped_bits_fall_back_to_the_newest_good_checkpoint_and_with_none_good_touch_nothing(
    finished_run, tmp_path, caplog
):
    config, workdir, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    folder = copy / "checkpoints"
    assert all((folder / step / checkpoints.DIGEST_FILE).exists() for step in ("10", "20"))

    # the parameters' and moments' data: whether TensorStore then reads it (a raw chunk) or fails (a
    # compressed one's header), the digest names the file
    damaged = largest_file(folder / "20" / "state")
    flip_a_bit(damaged)
    step, _ = prepare_run(parse(config), copy).restore_params()
    assert step == 10
    assert (
        f"{damaged} is changed since it was saved" in caplog.text
        and "fell back to the checkpoint at step 10" in caplog.text
    )

    flip_a_bit(largest_file(folder / "10" / "state"))
    before, rows = snapshot(copy / "checkpoints"), (copy / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"no readable checkpoint in .*checkpoints \(tried steps \[20, 10\]\)"):
        training_loop.train_and_evaluate(parse(tiny_config(config.data_dir, num_train_steps=30)), copy)
    assert snapshot(copy / "checkpoints") == before and (copy / "metrics.jsonl").read_text() == rows


def test_a_failed_checkpoint_write_names_the_folder_and_the_run_resumes_once_fixed(
    shared_data_dir, tmp_path, monkeypatch
):
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def disk_full_at_step_20(self):
        if self._final_path.name == "20":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.get()))
        return await finalize(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full_at_step_20)
    config = tiny_config(shared_data_dir, num_train_steps=20, eval_every_steps=20)
    with pytest.raises(
        CheckpointError, match=rf"cannot write a checkpoint to {tmp_path}/checkpoints \(No space left on device\)"
    ):
        training_loop.train_and_evaluate(parse(config), tmp_path)
    assert prepare_run(parse(config), tmp_path).checkpoints.steps() == [10]

    # the disk is fixed
    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    training_loop.train_and_evaluate(parse(config), tmp_path)
    assert prepare_run(parse(config), tmp_path).checkpoints.steps() == [10, 20]
    assert [r["step"] for r in metric_rows(tmp_path) if r["split"] == "train"] == [5, 10, 15, 20]


@pytest.mark.slow
def test_sigkill_inside_a_save_during_eval_and_at_a_random_step_then_a_rerun_equals_a_whole_run(
    whole_tiny_run, shared_data_dir, tmp_path
):
    """Killed inside the save at step 20 (nothing committed), then during the evaluation at 30, then at a
    random step past the checkpoint at 40, each time run again by the same command. (A kill in the
    first step left less than the kill inside the first save leaves, whose rerun starts from no
    committed checkpoint too, with rows, an Orbax temporary and a dead process's lock besides.)"""
    flags = WHOLE_RUN_FLAGS
    cut = tmp_path / "cut"
    # after the checkpoint at 40
    random_step = random.Random(0).randint(41, 59)
    for point, saved in (("save:20", []), ("eval", [20]), (f"step:{random_step}", [20, 40])):
        killed = run_train_py(cut, shared_data_dir, *flags, script=FAULT_WORKER, point=point)
        output = killed.communicate(timeout=300)[0]
        assert killed.returncode == -signal.SIGKILL, f"{point}: {output}"
        assert sorted(int(p.name) for p in (cut / "checkpoints").iterdir() if p.name.isdigit()) == saved, point
    resumed = run_train_py(cut, shared_data_dir, *flags)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0 and "resuming from the checkpoint at step 40" in output, output
    # --config.curves_png=false (TINY_FLAGS)
    assert not (cut / "curves.png").exists()

    assert compare_runs.metric_rows(cut) == compare_runs.metric_rows(whole_tiny_run)
    assert_same_final_state(tiny_config(shared_data_dir, num_train_steps=60), whole_tiny_run, cut, 60)


# ---------------------------------------------------------------- several processes


def two_processes(
    workdir: Path,
    data_dir,
    steps: int,
    *,
    coordinator: str = "cluster",
    sigterm_at: int | None = None,
    sharding: str = "replicated",
    devices: int = 2,
) -> list[subprocess.Popen]:
    """Two processes training together on `devices` CPU devices each; `cluster`: joined by a faked SLURM
    job of two tasks (the environment SLURM gives srun's tasks), which JAX detects. With `sigterm_at`
    the second process is sent SIGTERM while that step runs (by itself: the step is then known)."""
    port = str(29000 + os.getpid() % 1000)
    workers = []
    for index in range(2):
        # the test process's matmul precision (tests/conftest.py), for the tests that compare with in-process runs
        environment = {
            **os.environ,
            "XLA_FLAGS": xla_flags(devices),
            "JAX_DEFAULT_MATMUL_PRECISION": str(jax.config.jax_default_matmul_precision),
        }
        if coordinator == "cluster":
            environment.update(
                SLURM_JOB_ID="4242",
                SLURM_STEP_NODELIST="127.0.0.1",
                SLURM_NTASKS="2",
                SLURM_PROCID=str(index),
                SLURM_LOCALID=str(index),
                JAX_COORDINATOR_PORT=port,
            )
        signalled = sigterm_at if sigterm_at is not None and index == 1 else 0
        command = [
            sys.executable,
            str(TWO_PROCESS_WORKER),
            str(index),
            coordinator.replace("PORT", port),
            str(workdir),
            str(data_dir),
            str(steps),
            str(signalled),
            sharding,
        ]
        workers.append(
            subprocess.Popen(
                command, cwd=PROJECT_ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return workers


def finished(workers: list[subprocess.Popen], exit_code: int = 0) -> list[str]:
    """The workers' outputs, once each has exited with `exit_code` (stopped: 128 + SIGTERM)."""
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
    for worker in workers:
        assert worker.returncode == exit_code, "\n\n".join(outputs)
    return outputs


def test_a_faked_slurm_job_of_two_tasks_is_detected_and_a_one_task_job_is_not(monkeypatch):
    for name in (
        "SLURM_JOB_ID",
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "OMPI_MCA_orte_hnp_uri",
    ):
        monkeypatch.delenv(name, raising=False)
    assert cluster.detected_cluster() is None
    monkeypatch.setenv("SLURM_JOB_ID", "7"), monkeypatch.setenv("SLURM_STEP_NODELIST", "node[001-002]")
    monkeypatch.setenv("SLURM_PROCID", "0"), monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    # an allocation without srun: one process, trains alone
    assert cluster.detected_cluster() is None
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert cluster.detected_cluster() == "slurm"


def test_every_process_decides_from_the_smallest_device_memory_of_all(monkeypatch):
    """Preflight's stops and a search's gather follow one device's memory: each process asks its
    own devices, and all take the smallest answer (hosts may differ), so that none decides alone.
    A mesh of one process's devices (inference's) asks no other."""
    ours = jax.devices()[0]
    own = cluster.device_memory_bytes(cluster.make_mesh([ours]))
    assert own > 0
    # another host's, in whole MiB as they travel
    others = {"smaller": (own >> 20) // 3, "larger": (own >> 20) * 3}
    asked = []

    def allgather(value):
        asked.append(int(value))
        # the other process first: the order of process indices
        return np.array([others[case], int(value)])

    monkeypatch.setattr(cluster.multihost_utils, "process_allgather", allgather)
    # a device of process 1, which only it can ask
    theirs = types.SimpleNamespace(process_index=1)
    mesh = types.SimpleNamespace(devices=np.array([theirs, ours], dtype=object))
    for case, expected in (("smaller", others["smaller"] << 20), ("larger", own >> 20 << 20)):
        assert cluster.device_memory_bytes(mesh) == expected, case
    assert asked == [own >> 20] * 2
    # one process's mesh
    assert cluster.device_memory_bytes(cluster.make_mesh([ours])) == own and len(asked) == 2


@pytest.mark.slow
@pytest.mark.all_devices
def test_sigterm_to_one_of_two_processes_stops_both_after_the_same_step_and_the_resumed_run_equals_a_whole_one(
    shared_data_dir, tmp_path, monkeypatch
):
    """Two processes of one device each, cut by SIGTERM to one of them and resumed, end bit for bit where
    one process on two devices ends, rows and evaluations included: the gradients' mean over two devices
    sums two numbers (the same either way round) and each process reads its block of every batch."""
    # JAX agrees on a step a little later: within a second of the signal, and the signalled process's
    # later steps take 0.2 s each (helpers/two_process_worker.py); between two log rows (every 4), the resumed run
    # completes the cut one
    steps, sigterm_at = 20, 9
    whole = tmp_path / "whole"
    monkeypatch.setattr(run_module, "make_mesh", first_devices_mesh(2))
    training_loop.train_and_evaluate(parse(two_process_config(shared_data_dir, steps)), whole)

    cut = tmp_path / "cut"
    outputs = finished(
        two_processes(cut, shared_data_dir, steps, sigterm_at=sigterm_at, devices=1), 128 + signal.SIGTERM
    )
    assert "process 0 of 2 on 2 devices" in outputs[0] and "process 1 of 2 on 2 devices" in outputs[1]
    stopped = [re.search(r"saves a checkpoint after step (\d+)", output) for output in outputs]
    assert all(stopped), outputs
    stopped = [int(match.group(1)) for match in stopped]
    assert stopped[0] == stopped[1] and sigterm_at <= stopped[0] < steps, outputs
    assert sorted(int(p.name) for p in (cut / "checkpoints").iterdir() if p.name.isdigit()) == [stopped[0]]

    finished(two_processes(cut, shared_data_dir, steps, devices=1))
    assert f"resuming from the checkpoint at step {stopped[0]}" in (cut / "log.txt").read_text()
    rows = compare_runs.metric_rows(cut)
    assert rows == compare_runs.metric_rows(whole)
    assert {"dev", "test"} <= {row["split"] for row in rows if "loss" in row}
    assert_same_final_state(tiny_config(shared_data_dir, num_train_steps=steps), whole, cut, steps)


@pytest.mark.slow
@pytest.mark.all_devices
def test_two_processes_under_fsdp_train_as_one_process_on_four_devices(shared_data_dir, tmp_path, monkeypatch):
    """Parameters and Adam moments sharded over the devices of both processes (`fsdp`, data=4):
    the pair's logged metrics (training and evaluation) and final state are those of one process
    on 4 devices."""
    steps = 8
    finished(two_processes(tmp_path / "pair", shared_data_dir, steps, coordinator="127.0.0.1:PORT", sharding="fsdp"))
    assert "sharding fsdp over (data=4, model=1)" in (tmp_path / "pair" / "log.txt").read_text()
    meshes = []

    def four_devices(*args, **kwargs):
        meshes.append(first_devices_mesh(4)(*args, **kwargs))
        return meshes[-1]

    monkeypatch.setattr(run_module, "make_mesh", four_devices)
    config = two_process_config(shared_data_dir, steps, "fsdp")
    training_loop.train_and_evaluate(parse(config), tmp_path / "one")
    assert [dict(mesh.shape) for mesh in meshes] == [{"data": 4, "model": 1}]

    pair, one = metric_rows(tmp_path / "pair"), metric_rows(tmp_path / "one")
    assert [(r["step"], r["split"]) for r in pair] == [(r["step"], r["split"]) for r in one]
    # two training rows, dev and test
    assert sum("loss" in r for r in pair) >= 4
    for a, b in zip(pair, one):
        assert a.keys() == b.keys()
        for name in a.keys() - {"step", "split", *compare_runs.TIMING_COLUMNS}:
            np.testing.assert_allclose(
                a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=f"{name} at step {a['step']} {a['split']}"
            )

    states = [final_state(config, tmp_path / workdir, steps) for workdir in ("pair", "one")]
    for part in ("params", "opt_state"):
        for a, b in zip(jax.tree.leaves(states[0][part]), jax.tree.leaves(states[1][part]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7, err_msg=part)
