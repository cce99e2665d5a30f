"""The sweep's results: a row per counted trial, best first; results.md, results.csv and report.html
(rewritten as each trial ends); the objective plotted against each swept field (drawn when the
sweep ends: report.html charts it as each trial ends)."""

from __future__ import annotations

import csv
import os
import shlex
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from report import pages
from tuning.study import Sweep, kept_for, override_flags, trial_folder, trials_toward_the_count

# and per-module metrics (names with "/")
NOT_SHOWN = ("step", "decoded_examples")


def result_rows(study: optuna.Study, sweep: Sweep) -> list[dict]:
    """The counted trials, best first: finished by objective, then pruned, then failed or running."""
    sign = -1.0 if sweep.direction == "maximize" else 1.0
    order = {TrialState.COMPLETE: 0, TrialState.PRUNED: 1}
    trials = [t for t in trials_toward_the_count(study.get_trials(deepcopy=False)) if t.state != TrialState.WAITING]
    trials.sort(key=lambda t: (order.get(t.state, 2), sign * t.value if t.value is not None else 0.0, t.number))
    rows = []
    for trial in trials:
        row = {"trial": trial.number, "state": trial.state.name.lower(), sweep.objective: trial.value}
        row.update(trial.params)
        row.update(
            steps=trial.user_attrs.get("steps"),
            wall_s=round(trial.duration.total_seconds(), 1) if trial.duration else None,
        )
        metrics = trial.user_attrs.get("metrics", {})
        row.update(
            {f"{sweep.objective_split}/{k}": v for k, v in metrics.items() if k not in NOT_SHOWN and "/" not in k}
        )
        row.update(error=trial.user_attrs.get("error", ""), workdir=trial.user_attrs.get("workdir", ""))
        rows.append(row)
    return rows


def write_results(
    study: optuna.Study, sweep: Sweep, args, *, picture: bool = True, kept: dict[str, Any] | None = None
) -> Path:
    """results.csv, results.md and report.html, and with `picture` objective_by_field.png; returns
    results.md's path. `kept`: the fields the sweep keeps as it began (`as_the_sweep_began`), which
    the command that reproduces the best gets where it does not set them."""
    workdir = Path(args.workdir)
    rows = result_rows(study, sweep)
    for row in rows:
        row["workdir"] = trial_folder(row["workdir"], workdir)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(workdir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Sweep {study.study_name}",
        "",
        f"config `{args.config}`, sweep `{args.sweep}`: {sweep.method}, {sweep.num_trials} trials, "
        f"objective {sweep.objective} ({sweep.direction}); budget {sweep.budget}",
        "",
    ]
    if any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        best = study.best_trial
        command = as_it_ran(shlex.split(best.user_attrs["command"]), best.params, kept or {})
        command = [f"--workdir={workdir / 'best'}" if part.startswith("--workdir=") else part for part in command]
        command[:2] = ["python", os.path.relpath(command[1])]
        lines += [
            f"Best: trial {best.number}, {sweep.objective} = {best.value:.4g}. To reproduce it:",
            "",
            "```",
            shlex.join(command),
            "```",
            "",
        ]
    shown = [c for c in columns if c not in ("workdir",)]
    lines.append("| " + " | ".join(shown) + " |")
    lines.append("|" + "---|" * len(shown))
    for row in rows:
        lines.append("| " + " | ".join(format_cell(row.get(c)) for c in shown) + " |")
    (workdir / "results.md").write_text("\n".join(lines) + "\n")
    # matplotlib (and JAX, imported by report.pictures) only in the process that ends the sweep
    if picture:
        plot_objective(rows, sweep, workdir / "objective_by_field.png")
    pages.write_sweep(workdir, rows, sweep.objective, sweep.space)
    return workdir / "results.md"


def as_it_ran(command: list[str], params: dict[str, Any], kept: dict[str, Any]) -> list[str]:
    """A trial's `command` with the fields the sweep keeps (`kept`) that it does not set: a trial that
    ran before today's code changed their defaults ran them at the values kept, without a flag.
    Only for a trial of the kept fields' model family."""
    # the config file's family unless the sweep chose the trial's
    flags = override_flags(kept_for(kept, params.get("model.name", kept.get("model.name"))))
    given = {part.split("=")[0] for part in command}
    return command + [flag for flag in flags if flag.split("=")[0] not in given]


def format_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def plot_objective(rows: list[dict], sweep: Sweep, path: Path) -> None:
    """The objective of each finished trial against each swept field."""
    from report import pictures

    done = [r for r in rows if r["state"] == "complete"]
    figure = pictures.new_figure(figsize=(4.5 * len(sweep.space), 3.6))
    axes = figure.subplots(1, len(sweep.space), squeeze=False)
    for axis, (name, space) in zip(axes[0], sweep.space.items()):
        values = [r[name] for r in done]
        if space[0] == "categorical":
            labels = [str(c) for c in space[1]]
            values = [labels.index(str(v)) for v in values]
            axis.set_xticks(range(len(labels)), labels)
        elif space[0] == "log_uniform":
            axis.set_xscale("log")
        axis.scatter(values, [r[sweep.objective] for r in done])
        axis.set_xlabel(name)
        axis.set_ylabel(sweep.objective)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
