"""Hyperparameter sweeps over config fields, on Optuna.

    python sweep.py --config=configs/default.py --sweep=configs/sweeps/smoke.py --workdir=runs/smoke
    python sweep.py ... --parallel=2                           # two local workers on one study
    python sweep.py ... --storage=postgresql://user@host/db    # workers on several machines, one study

A sweep file (`configs/sweeps/NAME.py`, see `smoke.py`) declares the search
space over config fields, the method (grid, random or TPE), the number of
trials, the objective and its direction, and the budget: config overrides
every trial gets. Each trial is a `train.py` run in its own folder
`WORKDIR/trials/trial_<N>`, its output in `log.txt` there. The worker
follows the trial's `metrics.jsonl` and reports the objective at each
evaluation; a median pruner stops trials that lag (SIGTERM: train.py saves
and stops).

The study lives in `WORKDIR/study.journal` (Optuna's journal file, safe for
several processes on one machine) unless `--storage` names a database
(PostgreSQL, or SQLite for one machine). Run the same command again and the
sweep goes on where it stopped: finished trials are never rerun, trials cut
short are queued again and resume from their checkpoint, failed trials stay
recorded with their error.

The first process to open a study records the sweep in it and queues a
grid's points; this happens under a lock that every process opening the
study takes, so sweeps started at the same moment queue each grid point once
and a study made by another sweep is refused. With `--storage=postgresql://`
the lock is in the database (an advisory lock), so it holds between
machines with workdirs of their own; for SQLite it is a file beside the
database, for the journal file one in WORKDIR.

Devices: each of the `--parallel` workers runs one trial at a time, and on
a machine with NVIDIA GPUs (CUDA_VISIBLE_DEVICES, or those `nvidia-smi -L`
lists) with two or more workers, each worker gets a block of its own:
len(GPUs) // N GPUs in CUDA_VISIBLE_DEVICES (the rest stay idle, so every
trial shards alike), and XLA_PYTHON_CLIENT_PREALLOCATE=false unless it is
set; its trials inherit them. More workers than GPUs is refused: two trials on one GPU
contend for its memory and time. One worker, or a machine without GPUs
(or JAX_PLATFORMS without cuda), keeps the environment as it is. TPUs are
not split: run one worker per TPU host.

Results: `WORKDIR/results.md` and `results.csv` (trials by objective, with
overrides, steps, wall time, metrics, and the command that reproduces the
best), and `WORKDIR/objective_by_field.png`.
"""

from __future__ import annotations

if __name__ == "__main__":
    from utils import allocator

    allocator.collect_less_while_importing()

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import sqlalchemy
from absl import flags

from configs import base
from run_setup import command_line
from tuning.results import write_results
from tuning.study import SweepError, as_the_sweep_began, load_sweep, open_study, trials_toward_the_count
from tuning.trial import run_worker, visible_gpus, worker_environment
from utils import progress, stop_signals
from utils.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent


# the command's own, parsed by run_setup.command_line like every script's
FLAGS = flags.FlagValues()
flags.DEFINE_string(
    "config",
    None,
    "the experiment config file train.py runs (FILE.py or FILE.py:ARG)",
    required=True,
    flag_values=FLAGS,
)
flags.DEFINE_string("sweep", None, "the sweep file (configs/sweeps/NAME.py)", required=True, flag_values=FLAGS)
flags.DEFINE_string("workdir", None, "the sweep folder: study, trials, results", required=True, flag_values=FLAGS)
flags.DEFINE_integer("parallel", 1, "worker processes on this machine", flag_values=FLAGS)
flags.DEFINE_string("storage", "", "database URL of a shared study, e.g. postgresql://user@host/db", flag_values=FLAGS)
flags.DEFINE_string(
    "study_name", "", "the study's name in the storage (default: the workdir's name)", flag_values=FLAGS
)
flags.DEFINE_string(
    "train_script", str(PROJECT_ROOT / "train.py"), "what runs a trial (train.py's flags)", flag_values=FLAGS
)
flags.DEFINE_integer("worker_index", None, "internal: set for the worker processes", flag_values=FLAGS)
# how often the sweep's progress looks at the study
POLL_SECONDS = 2.0


def parse_args(argv: list[str]) -> flags.FlagValues:
    """The flags of `argv` (the program's name left out): read as attributes (`args.workdir`)."""
    command_line.parse(FLAGS, ["sweep.py", *argv], __doc__)
    if FLAGS.parallel < 1:
        raise SweepError(f"--parallel must be at least 1, got {FLAGS.parallel}")
    return FLAGS


def finished_trials(study: optuna.Study, known: int = 0) -> int:
    """Trials of the sweep's count that have ended (complete, pruned or failed); `known` when the
    storage cannot be read just now (the workers have their own connections and retries)."""
    try:
        return sum(t.state.is_finished() for t in trials_toward_the_count(study.get_trials(deepcopy=False)))
    except (sqlalchemy.exc.SQLAlchemyError, OSError):
        return known


def launch_workers(argv: list[str], environments: list[dict[str, str]], study: optuna.Study, num_trials: int) -> int:
    """Starts a worker process per environment and waits, showing the trials done of `num_trials`
    (`progress.phase`); SIGTERM/SIGINT are passed on to the workers."""
    workers = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *argv, f"--worker_index={index}"],
            env=environment,
            # a Ctrl-C reaches this process only, which passes it on once (a second one ends them at once)
            start_new_session=True,
        )
        for index, environment in enumerate(environments)
    ]

    def forward(signum: int) -> None:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)

    # a resumed sweep: what earlier runs finished
    done_before = finished_trials(study)
    # the workers stop their trials (which save), then end; the watcher ends this process at a second signal
    with (
        stop_signals.handled(on_signal=forward),
        stop_signals.deferred(),
        progress.phase("sweep", total=max(num_trials - done_before, 0), unit="trials") as shown,
    ):
        while running := [worker for worker in workers if worker.poll() is None]:
            # a progress line every POLL_SECONDS, and the sweep ends as soon as its last worker does
            try:
                running[0].wait(timeout=POLL_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            shown.advance(max(finished_trials(study, done_before + shown.done) - done_before - shown.done, 0))
        shown.advance(max(finished_trials(study, done_before + shown.done) - done_before - shown.done, 0))
    return max(worker.wait() for worker in workers)


def main(argv: list[str]) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        args = parse_args(argv)
        # a config file that does not load stops here, named
        base.load(args.config)
        sweep = load_sweep(args.sweep, args.config)
        if args.worker_index is not None:
            run_worker(args, sweep)
            return 0
        gpus = visible_gpus(os.environ)
        environments = [worker_environment(index, args.parallel, os.environ, gpus) for index in range(args.parallel)]
        if gpus and args.parallel > 1:
            print(
                "GPUs by worker: " + "; ".join(f"{i}: {e['CUDA_VISIBLE_DEVICES']}" for i, e in enumerate(environments)),
                flush=True,
            )
        # creates the study (and queues the grid) once, before the workers
        study = open_study(args, sweep)
        # the sweep's progress lines (absl's handler shows them on stderr)
        logging.getLogger().setLevel(logging.INFO)
        # refused here, before any worker starts, where the code or config file changed what the trials run
        kept = as_the_sweep_began(study, args, sweep)
        status = launch_workers(argv, environments, study, sweep.num_trials)
        results = write_results(study, sweep, args, kept=kept)
    except ConfigError as error:
        print(f"sweep.py: error: {error}", file=sys.stderr)
        return 2
    states = [t.state.name.lower() for t in trials_toward_the_count(study.get_trials(deepcopy=False))]
    print(f"{len(states)} trials: " + ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states)))
    print(f"results: {results}, {results.with_suffix('.csv')}, {results.parent / 'objective_by_field.png'}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
