"""Running trials: one trial (train.py followed through its metrics.jsonl, reported, pruned,
told), a worker's loop over the study's trials, trials of dead workers queued again, and each
worker's environment (its GPUs)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from tuning.results import write_results
from tuning.study import (
    Sweep,
    SweepError,
    as_the_sweep_began,
    distributions,
    kept_for,
    open_study,
    override_flags,
    requeue,
    trials_toward_the_count,
    with_overrides,
)
from utils import stop_signals

# a running trial's worker says it is alive this often
HEARTBEAT_S = 30
# ... and is taken for dead after this long without
HEARTBEAT_GRACE_S = 300
# prefixes that make JAX join a cluster
CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "JAX_COORDINATOR_")


# ---------------------------------------------------------------- one trial


def trial_command(args, workdir: Path, overrides: dict[str, Any]) -> list[str]:
    return [
        sys.executable,
        str(args.train_script),
        f"--config={args.config}",
        f"--workdir={workdir}",
        *override_flags(overrides),
    ]


class MetricsFollower:
    """A run's `metrics.jsonl` as train.py writes it: each `poll` reads only the new complete lines.

    train.py truncates the file to its checkpoint's step when it resumes; the
    follower then reads it again from the start.
    """

    def __init__(self, workdir: Path):
        self.path = workdir / "metrics.jsonl"
        self.offset = 0
        self.rows: list[dict] = []

    def poll(self) -> list[dict]:
        """The rows written since the last poll."""
        if not self.path.exists():
            return []
        if self.path.stat().st_size < self.offset:
            self.offset, self.rows = 0, []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        # a line still being written waits for the next poll
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        new = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        self.rows.extend(new)
        return new


def last_lines(path: Path, count: int = 3) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return " | ".join((errors or lines)[-count:])[-1000:] or "no output"


def run_trial(study: optuna.Study, trial: optuna.Trial, args, sweep: Sweep, kept: dict[str, Any]) -> None:
    """Runs train.py for the trial, with the fields the sweep keeps as it began (`kept`, see
    `as_the_sweep_began`) where its model is theirs, reports the objective, prunes, and tells the
    study the outcome. A stop request (SIGTERM/SIGINT) stops the trial, which saves its checkpoint."""
    workdir = Path(trial.user_attrs.get("workdir") or Path(args.workdir) / "trials" / f"trial_{trial.number:04d}")
    workdir.mkdir(parents=True, exist_ok=True)
    config = with_overrides(args.config, {**sweep.budget, **trial.params}, f"trial {trial.number}")
    # (a config that is not attend's has no model, and keeps nothing)
    family = config.model.name if kept else None
    overrides = {**sweep.budget, **kept_for(kept, family), **trial.params}
    num_train_steps = config.num_train_steps
    command = trial_command(args, workdir, overrides)
    trial.set_user_attr("workdir", str(workdir))
    trial.set_user_attr("command", shlex.join(command))
    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    reported: set[int] = set()
    metrics = MetricsFollower(workdir)
    outcome, heartbeat = None, 0.0
    with open(workdir / "log.txt", "a") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(), start_new_session=True
        )
        TRAINING[:] = [process]
        while True:
            running = process.poll() is None
            for row in metrics.poll():
                value = row.get(sweep.objective_metric)
                if row.get("split") == sweep.objective_split and value is not None and row["step"] not in reported:
                    reported.add(row["step"])
                    trial.report(float(value), row["step"])
                    if running and row["step"] < num_train_steps and trial.should_prune():
                        outcome = "pruned"
            if not running:
                break
            if outcome or stop_signals.requested():
                # train.py saves a checkpoint and stops (told once: a second SIGTERM would end it at once)
                pass_on(signal.SIGTERM, count=1)
                process.wait()
                # read the rows it wrote on the way out
                continue
            if time.time() - heartbeat > HEARTBEAT_S:
                heartbeat = time.time()
                trial.set_user_attr("heartbeat", heartbeat)
            # the poll's pace, but no longer than the trial runs
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.2)
    rows = metrics.rows
    final = [r for r in rows if r.get("split") == sweep.objective_split and r["step"] == num_train_steps]
    trial.set_user_attr("steps", max((r["step"] for r in rows), default=0))
    if final:
        trial.set_user_attr("metrics", {k: v for k, v in final[-1].items() if isinstance(v, (int, float))})
    if outcome == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    elif stop_signals.requested() and not final:
        trial.set_user_attr("error", "interrupted; queued again, to resume from its checkpoint")
        study.tell(trial, state=TrialState.FAIL)
        requeue(study, trial)
    elif process.returncode != 0 or not final or sweep.objective_metric not in final[-1]:
        have = sorted(k for k in (final[-1] if final else {}) if k not in ("step", "split"))
        error = (
            f"train.py exited with {process.returncode}: {last_lines(workdir / 'log.txt')}"
            if process.returncode
            else f"no {sweep.objective} at step {num_train_steps} in {workdir / 'metrics.jsonl'} "
            f"(have: {', '.join(have) or 'nothing'})"
        )
        trial.set_user_attr("error", error)
        study.tell(trial, state=TrialState.FAIL)
    else:
        value = float(final[-1][sweep.objective_metric])
        if not math.isfinite(value):
            trial.set_user_attr("error", f"objective {sweep.objective} is {value}")
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, value)


# ---------------------------------------------------------------- a worker


# the trial's train.py process, while it runs, and the SIGTERMs it was sent
TRAINING: list[subprocess.Popen] = []
TOLD: dict[int, int] = {}


def pass_on(signum: int, count: int | None = None) -> None:
    """The worker's `count`-th stop signal (default: as many as it was sent) goes to its trial's train.py,
    in a session of its own which a Ctrl-C does not reach: the first makes it save and stop, a second
    ends it at once. Each is sent once, however many times it is passed on."""
    count = stop_signals.count() if count is None else count
    for process in TRAINING:
        while process.poll() is None and TOLD.get(process.pid, 0) < count:
            # counted first: a signal to this worker between the two would send it again
            TOLD[process.pid] = TOLD.get(process.pid, 0) + 1
            process.send_signal(signal.SIGTERM)


def run_worker(args, sweep: Sweep) -> None:
    """One worker: takes queued or new trials until the sweep's trials are all done or taken. A stop
    signal stops its trial (which saves) and the worker."""
    with stop_signals.handled(on_signal=pass_on), stop_signals.deferred():
        work_until_done(args, sweep)


def work_until_done(args, sweep: Sweep) -> None:
    study = open_study(args, sweep)
    kept = as_the_sweep_began(study, args, sweep)
    space = distributions(sweep)
    while not stop_signals.requested():
        recover_dead_trials(study)
        trials = study.get_trials(deepcopy=False)
        waiting = any(t.state == TrialState.WAITING for t in trials)
        if not waiting and (sweep.method == "grid" or len(trials_toward_the_count(trials)) >= sweep.num_trials):
            break
        trial = study.ask(space)
        earlier = trials_toward_the_count([t for t in study.get_trials(deepcopy=False) if t.number < trial.number])
        if not trial.user_attrs.get("queued") and (sweep.method == "grid" or len(earlier) >= sweep.num_trials):
            # another worker took the last one meanwhile
            trial.set_user_attr("surplus", True)
            study.tell(trial, state=TrialState.FAIL)
            continue
        run_trial(study, trial, args, sweep, kept)
        # the sweep's page and tables as of this trial; the picture at the end
        write_results(study, sweep, args, picture=False, kept=kept)


def recover_dead_trials(study: optuna.Study) -> None:
    """Trials left RUNNING by a worker that died (killed, or its machine lost): failed, then queued again.

    A worker is dead when it ran on this machine and its process is gone, or
    when its heartbeat (refreshed while its trial runs) is older than `HEARTBEAT_GRACE_S`.
    """
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = trial.user_attrs.get("worker", "").rpartition(":")
        gone = worker_host == host and pid and not pid_alive(int(pid))
        silent = time.time() - trial.user_attrs.get("heartbeat", time.time()) > HEARTBEAT_GRACE_S
        if not (gone or silent):
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (RuntimeError, ValueError):
            # another worker got there first
            continue
        requeue(study, trial)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The NVIDIA GPUs a trial could use, named as CUDA_VISIBLE_DEVICES names them: that variable's list
    when it is set (indices, GPU- or MIG- UUIDs), else the indices `nvidia-smi -L` lists; none when
    JAX_PLATFORMS leaves CUDA out or there is no nvidia-smi (a CPU-only machine)."""
    platforms = {p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    if platforms and not platforms & {"cuda", "gpu"}:
        return []
    if "CUDA_VISIBLE_DEVICES" in environ:
        names = [name.strip() for name in environ["CUDA_VISIBLE_DEVICES"].split(",")]
        # as CUDA reads it
        return list(itertools.takewhile(lambda name: name and not name.startswith("-"), names))
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True, env=dict(environ)
        ).stdout
    except (OSError, subprocess.SubprocessError):
        # no nvidia-smi, no driver
        return []
    return re.findall(r"^GPU (\d+):", listing, flags=re.MULTILINE)


def worker_environment(index: int, parallel: int, environ: Mapping[str, str], gpus: list[str]) -> dict[str, str]:
    """The environment of worker `index` of `parallel`, which its trials (train.py) inherit.

    With two or more workers and `gpus` (see `visible_gpus`), worker i gets the
    i-th contiguous block of len(gpus) // parallel of them as CUDA_VISIBLE_DEVICES
    (the remainder stay idle, so every trial has as many devices and shards its
    batch alike) and XLA_PYTHON_CLIENT_PREALLOCATE=false unless `environ` sets
    it. Without GPUs, or with one worker, `environ` as it is. Either way without the variables of
    a cluster launcher (`CLUSTER_VARIABLES`): each trial trains alone.

    Raises:
      SweepError: fewer GPUs than workers; two trials would contend for one GPU.
    """
    # A trial is one process: under srun or mpirun the cluster's variables would make every trial
    # join the others as one distributed run (run_setup.cluster.setup_distributed).
    environment = {k: v for k, v in environ.items() if not k.startswith(CLUSTER_VARIABLES)}
    if not gpus or parallel == 1:
        return environment
    if len(gpus) < parallel:
        raise SweepError(
            f"--parallel={parallel} but this machine has {len(gpus)} GPU(s) ({','.join(gpus)}), and two trials "
            f"would contend for one; use --parallel={len(gpus)} or fewer"
        )
    size = len(gpus) // parallel
    environment["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[index * size : (index + 1) * size])
    environment.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return environment
