"""The families on real text for the same planned time: Transformer, RNNsearch, RNNencdec (RNNsearch
without attention: Bahdanau's contrast) and LSTMN (shallow and deep fusion) trained on the shipped
kjv_web corpus, three seeds each, scored on its test split with beam 4.

    python benchmarks/kjv_comparison.py --workdir=runs/kjv_comparison              # 20 minutes each
    python benchmarks/kjv_comparison.py --workdir=runs/kjv_comparison --minutes=20 --tune_fraction=0.5 --seeds=3

Each column starts from its kjv_web config (configs/kjv_web_transformer.py, rnnsearch_kjv_web.py,
rnnencdec_kjv_web.py, lstmn_kjv_web.py, the last with `fusion="deep"` and
`inter_query="word_and_context"` for `lstmn_deep`) and goes through three stages:

1. **The budget.** `--minutes` of training at the column's speed on this machine (`SPEEDS`, each
   measured with nothing else running; `--measure_speed` measures them again, on another
   machine): every family is planned the same time, however fast its step. All runs share one
   schedule rule: linear warmup over the first tenth of the steps, then cosine decay to 0 at the
   last (each family's own schedule was set for runs many times longer); everything else is the
   config's.
2. **Its learning rate.** Runs of half the budget's steps (`--tune_fraction`) at the config's
   rate times 1/2, 1 and 2 (then doubled or halved again, up to 8 rates, while the best is at an
   edge); the rate whose run ends with the lowest dev loss is kept. Half, not the 2 minutes of the
   first comparison, whose runs left the Transformer on its early loss plateau (dev loss 6.00 and
   6.01 at two rates): in half-budget runs (432 steps) its training loss stays at 5.2-5.3 until
   step 90-110 and then falls, and the three rates end 2.73, 2.89 and 3.38 apart. Where the
   runner-up's dev loss is still within 1% of it, the tuning runs did not tell the two apart, and
   both rates get the full budget, each a row of the table (a third rate within 1% is not trained).
3. **The test split**, evaluated whole with beam 4 (a first call, decoding one example, compiles
   the programs): BLEU and chrF (sacrebleu), and sentences per second of the timed call (its
   teacher-forced loss pass included, a small part beside the search); each sentence's best
   hypothesis is kept (`test_hypotheses.json`) for the scores by source length and the paired
   bootstrap.

The tuned rate is trained at `--seeds` seeds (parameters, dropout and data order), every column's
seed 0 first, so that a benchmark stopped early has whole rows to show.

A last row scores the test split's sources as their own translations (no model): KJV and WEB
share most of their words, so that is the floor a model has to clear.

A tuning run whose loss stops being finite counts as the worst rate (`diverged.json` in its folder).
Every run, and each test decoding, is a fresh process set up as train.py's are (huge pages, the
allocator, the compilation cache): a process that has trained several models trains the next one
slower.

`--parallel_runs=N` trains N runs at once, each in its own process (a grid's first rates, its
extension N rates out at a time, then the final runs in their order), and decodes their test
splits N at once: for an accelerator, which one small model's run leaves mostly idle. Each run
keeps the device it trained on and how many trained at once (`devices.json`), each decoding its
device and how many started with it (`test.json`); the table shows both, since a speed measured
beside others is a share of the device. The grid's extension may then try a rate beyond the edge
that one rate at a time would not have (`plan.json`'s `rates_at_once`).

Prints a markdown table. Stages already done are read back, not rerun (`WORKDIR/<column>/plan.json`
holds a column's rate and steps, and the budget they were planned for: a rerun with other
`--minutes` or `--tune_fraction` stops, naming the file to delete; a run folder with checkpoints
resumes from them), so the benchmark can be stopped and started again. The table's `train min`
(the logged rows' steps over their speed, compilation included) says how long each run took: more
than the budget where the machine was busy with other work meanwhile.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from absl import flags  # noqa: E402

import tasks  # noqa: E402
import train as train_py  # noqa: E402
from engine import (
    evaluation,  # noqa: E402
    training_loop,  # noqa: E402
)
from run_setup import command_line, compatibility, preflight  # noqa: E402
from run_setup.run import model_fields, prepare_run  # noqa: E402
from run_setup.settings import parse  # noqa: E402
from scoring import score_registry, significance  # noqa: E402
from tasks import vocabularies  # noqa: E402
from utils import files, metric_writer, stop_signals  # noqa: E402
from utils.errors import NonFiniteLoss  # noqa: E402

# column: (config module, model fields over the config's)
COLUMNS = {
    "transformer": ("kjv_web_transformer", {}),
    "rnnsearch": ("rnnsearch_kjv_web", {}),
    # Bahdanau's contrast: RNNsearch's sizes without attention
    "rnnencdec": ("rnnencdec_kjv_web", {}),
    "lstmn_shallow": ("lstmn_kjv_web", {"fusion": "shallow"}),
    "lstmn_deep": ("lstmn_kjv_web", {"fusion": "deep", "inter_query": "word_and_context"}),
}
# Steps a second of each column's run on this repository's 2-core machine, each measured alone (the
# budget's steps are these times its seconds): the first comparison's (2026-11-26, the median of its
# 2-minute tuning runs) and RNNencdec's 200-step probe (2026-11-27, `--measure_speed`'s). Measured
# while the machine did other work they came out up to 3 times lower, so the benchmark does not
# measure them again by default: a long benchmark shares the machine with whatever else runs.
SPEEDS = {
    "transformer": 1294 / 1800,
    "rnnsearch": 2597 / 1800,
    "rnnencdec": 1.302,
    "lstmn_shallow": 1395 / 1800,
    "lstmn_deep": 1353 / 1800,
}
RATE_FACTORS = (0.5, 1.0, 2.0)
# the grid grows by doubling (or halving) while its best rate is at an edge (a diverged run is the
# worst, so the grid stops growing where the rates start to diverge)
MAX_RATES = 8
# steps: a probe or tuning run below it checkpoints only at its end
SHORT_RUN = 200
# tuning runs whose dev losses are this close (relative) do not tell their rates apart
TIE = 0.01
BEAM = 4
# the floor's row and line: the test sources taken as their own translations
COPIED = "the source copied"
# figure 2's buckets of fewer sentences are drawn apart from the lines (their intervals say little)
FEW_SENTENCES = 5

# this script's own (run_setup/command_line.py: absl's syntax, like train.py's)
FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", "runs/kjv_comparison", "", flag_values=FLAGS)
flags.DEFINE_float("minutes", 20.0, "training time of each column's run (steps: SPEEDS times it)", flag_values=FLAGS)
flags.DEFINE_float("tune_fraction", 0.5, "each learning-rate trial's steps over the budget's", flag_values=FLAGS)
flags.DEFINE_bool(
    "measure_speed",
    False,
    "measure each family's speed (on a machine that runs nothing else) instead of SPEEDS",
    flag_values=FLAGS,
)
flags.DEFINE_integer("seeds", 3, "runs of each column's tuned rate, seeds 0, 1, ...", flag_values=FLAGS)
flags.DEFINE_integer(
    "parallel_runs",
    1,
    "runs of a stage trained (or test splits decoded) at once, each in its own process: for an "
    "accelerator, which one small model's run leaves mostly idle; on a CPU the runs share its cores",
    flag_values=FLAGS,
)
flags.DEFINE_string("columns", ",".join(COLUMNS), f"comma-separated, of: {', '.join(COLUMNS)}", flag_values=FLAGS)
flags.DEFINE_string("data_dir", "data/tfds", "", flag_values=FLAGS)
flags.DEFINE_string(
    "figure", "docs/bleu_by_source_length.png", "where to draw BLEU by source length", flag_values=FLAGS
)


def column_config(column: str, learning_rate: float | None, steps: int, data_dir: str, seed: int = 0):
    """The column's config with `steps` under the shared schedule rule, its rate (the config's when
    None), evaluating and checkpointing only at the end (and every tenth, to resume). Every column
    asks for the same vocabulary: the first run trains it, the others take it from the shelf
    beside the built data."""
    module, fields = COLUMNS[column]
    config = importlib.import_module(f"configs.{module}").get_config()
    config.model.update(fields)
    config.data_dir = data_dir
    if learning_rate is not None:
        config.learning_rate = learning_rate
    config.num_train_steps = steps
    config.seed = seed
    config.warmup_steps = max(1, steps // 10)
    config.schedule = "cosine"
    config.log_every_steps = max(1, min(50, steps // 20))
    config.eval_every_steps = steps
    # the budget's run every tenth (it resumes); the short probe and tuning runs at their end only,
    # so that no save falls in the rows that measure their speed
    config.checkpoint_every_steps = max(1, steps // 10) if steps >= SHORT_RUN else steps
    # the dev loss picks the rate; the test split is decoded whole below
    config.eval_decode_examples = 32
    config.visualize_examples = 0
    config.decode.beam_size = BEAM
    config.lock()
    return config


def in_fresh_processes(calls: list[tuple], parallel: int = 1) -> None:
    """Each `(function, *args)` of `calls` in a new Python process, set up as train.py's are, at most
    `parallel` at once, waited for. A process that has trained several models runs the next one
    slower: LSTMN's run went at 0.59 steps/s after its tuning runs in the same process, 0.87 alone
    (docs/performance.md). A SIGTERM to this process is passed on to every child running (each
    saves its checkpoint and stops) and starts no other."""
    context = multiprocessing.get_context("spawn")
    pending, running, stopping = list(calls), [], []

    def stop(*_) -> None:
        stopping.append(True)
        pending.clear()
        for child, _ in running:
            if child.pid is not None:
                child.terminate()

    previous = signal.signal(signal.SIGTERM, stop)
    if parallel > 1:
        # several processes on one accelerator: each takes the memory it needs, not 75% of it
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        while pending or running:
            while pending and len(running) < max(1, parallel):
                function, *args = call = pending.pop(0)
                child = context.Process(target=set_up_and_call, args=(function, *args))
                running.append((child, call))
                child.start()
                # the signal came between the two lines above
                if stopping:
                    child.terminate()
            multiprocessing.connection.wait([child.sentinel for child, _ in running])
            for child, call in [(c, call) for c, call in running if c.exitcode is not None]:
                running.remove((child, call))
                # stopped by the signal passed on (its checkpoint saved): 128 + SIGTERM, or killed by it
                if child.exitcode not in (0, 128 + signal.SIGTERM, -signal.SIGTERM):
                    function, *args = call
                    raise SystemExit(
                        f"{function.__name__}{tuple(args[1:])} failed (exit code {child.exitcode}): see the lines above"
                    )
    finally:
        # all stopping at once: each saves within its own grace period
        for child, _ in running:
            if child.pid is not None:
                child.terminate()
        for child, _ in running:
            if child.pid is not None:
                child.join()
        signal.signal(signal.SIGTERM, previous)


def set_up_and_call(function, *args) -> None:
    # the allocator's settings, the collector and the compilation cache
    train_py.set_up_process()
    try:
        function(*args)
    except stop_signals.Stopped as stopped:
        # as train.py ends
        print(stopped.line(), file=sys.stderr, flush=True)
        sys.exit(stopped.exit_code)


def train_or_mark_diverged(config, workdir: Path, at_once: int = 1) -> None:
    record_device(workdir, at_once)
    try:
        training_loop.train_and_evaluate(parse(config), workdir)
    except NonFiniteLoss as error:
        # a rate too large: the worst, and not retried on a rerun
        (workdir / "diverged.json").write_text(json.dumps({"error": str(error)}))


def record_device(workdir: Path, at_once: int = 1) -> None:
    """Adds this process's device kind, and how many runs trained on it at once where several did, to
    the run's `devices.json` (a run resumed elsewhere lists both): the table says where each run
    trained, and whether its speed was a share of the device."""
    import jax

    path = workdir / "devices.json"
    kinds = json.loads(path.read_text()) if path.exists() else []
    kind = jax.devices()[0].device_kind + (f" ({at_once} at once)" if at_once > 1 else "")
    if kind not in kinds:
        workdir.mkdir(parents=True, exist_ok=True)
        files.write_whole(path, lambda temporary: temporary.write_text(json.dumps([*kinds, kind])))


def trained_on(workdir: Path) -> str:
    """The device kinds a run trained on (`devices.json`), or "?" for a run from before it was kept."""
    path = workdir / "devices.json"
    return " + ".join(json.loads(path.read_text())) if path.exists() else "?"


def train(config, workdir: Path) -> dict:
    """`train_all` of one run."""
    return train_all([(config, workdir)])[0]


def train_all(runs: list[tuple], parallel: int = 1) -> list[dict]:
    """Trains each `(config, workdir)` in a fresh process (unless finished), `parallel` at once, and
    returns `{"dev_loss", "steps_per_second", "train_seconds", "target_tokens"}` of each from its
    rows; its speed is the steps over the seconds of every row but the first (which holds the
    compilation), so that slow windows (long buckets) count in full."""
    finished = lambda config, workdir: workdir / "eval" / f"step_{config.num_train_steps}.json"  # noqa: E731
    done = lambda config, workdir: finished(config, workdir).exists() or (workdir / "diverged.json").exists()  # noqa: E731
    pending = [(c, w) for c, w in runs if not done(c, w)]
    at_once = min(max(1, parallel), len(pending))
    in_fresh_processes([(train_or_mark_diverged, c, w, at_once) for c, w in pending], parallel)
    # stopped by a signal, its checkpoint saved
    for config, workdir in runs:
        if not done(config, workdir):
            sys.exit(f"stopped before the end of {workdir}: the same command resumes it")
    return [trained(finished(config, workdir), workdir) for config, workdir in runs]


def trained(finished: Path, workdir: Path) -> dict:
    """A finished run's dev loss (inf where it diverged), speed, seconds and target tokens."""
    diverged = workdir / "diverged.json"
    rows = metric_writer.read_jsonl(workdir)
    train_rows = [r for r in rows if r["split"] == "train"]
    windows = list(zip(train_rows, window_steps(train_rows)))
    timed = windows[1:] or windows
    seconds = lambda windows: sum(steps / row["steps_per_second"] for row, steps in windows)  # noqa: E731
    return {
        "dev_loss": math.inf if diverged.exists() else json.loads(finished.read_text())["dev"]["loss"],
        "steps_per_second": sum(steps for _, steps in timed) / seconds(timed) if timed else math.nan,
        # compilation included
        "train_seconds": seconds(windows),
        "target_tokens": sum(steps * row["tokens_per_second"] / row["steps_per_second"] for row, steps in windows),
    }


def window_steps(train_rows: list[dict]) -> list[int]:
    """The steps each logged row covers (rows are written every `log_every_steps` and at the end)."""
    steps = [r["step"] for r in train_rows]
    return [b - a for a, b in zip([0, *steps], steps)]


def plan(column: str, args) -> dict:
    """The column's rate and steps (`plan.json`): tuned once, then read back."""
    path = Path(args.workdir) / column / "plan.json"
    if path.exists():
        planned = json.loads(path.read_text())
        if (planned["minutes"], planned["tune_fraction"]) != (args.minutes, args.tune_fraction):
            raise SystemExit(
                f"{path} was planned for --minutes={planned['minutes']:g} "
                f"--tune_fraction={planned['tune_fraction']:g}: rerun with those, or delete the column's folder"
            )
        return planned
    base_rate = column_config(column, None, 1, args.data_dir).learning_rate
    speed = SPEEDS[column] if not args.measure_speed else measured_speed(column, base_rate, args)
    steps = max(20, round(args.minutes * 60 * speed))
    tune_steps = max(20, round(args.tune_fraction * steps))
    trials = {}

    def try_rates(rates: list[float]) -> None:
        runs = [
            (column_config(column, rate, tune_steps, args.data_dir), Path(args.workdir) / column / f"tune_{rate:g}")
            for rate in rates
        ]
        trials.update(zip(rates, train_all(runs, args.parallel_runs)))

    try_rates([base_rate * factor for factor in RATE_FACTORS])
    best = min(trials, key=lambda rate: trials[rate]["dev_loss"])
    # the best at an edge: one more step out, or as many as run at once (the rates the grid would
    # try next while its best stays at the edge; where it does not, a rate tried beyond is spare)
    while best in (min(trials), max(trials)) and len(trials) < MAX_RATES:
        factor = 2.0 if best == max(trials) else 0.5
        count = min(max(1, args.parallel_runs), MAX_RATES - len(trials))
        try_rates([best * factor**k for k in range(1, count + 1)])
        best = min(trials, key=lambda rate: trials[rate]["dev_loss"])
    result = {
        "learning_rate": best,
        "steps": steps,
        "steps_per_second": speed,
        "minutes": args.minutes,
        "tune_fraction": args.tune_fraction,
        "tune_steps": tune_steps,
        # the grid's extension tries this many rates at a time (a spare rate beyond the edge may be tried)
        "rates_at_once": max(1, args.parallel_runs),
        # the grid stopped at MAX_RATES
        "best_at_edge": best in (min(trials), max(trials)),
        "dev_loss_by_rate": {f"{rate:g}": trial["dev_loss"] for rate, trial in trials.items()},
    }
    path.write_text(json.dumps(result, indent=2))
    return result


def measured_speed(column: str, base_rate: float, args) -> float:
    """Steps a second of a 200-step run at the config's rate (its first logged window, which holds the
    compilation, left out): on a machine that runs nothing else meanwhile."""
    probe = column_config(column, base_rate, 200, args.data_dir)
    return train(probe, Path(args.workdir) / column / "probe")["steps_per_second"]


def finalists(chosen: dict) -> list[float]:
    """The rates trained for the full budget: the tuned one (first), and the runner-up where its
    tuning run ended within `TIE` of the tuned one's dev loss."""
    best, losses = chosen["learning_rate"], chosen["dev_loss_by_rate"]
    best_loss = losses[f"{best:g}"]
    others = sorted((loss, float(rate)) for rate, loss in losses.items() if rate != f"{best:g}")
    tied = others and math.isfinite(best_loss) and others[0][0] <= best_loss * (1 + TIE)
    return [best, others[0][1]] if tied else [best]


def scores_on_test_split(runs: list[tuple], parallel: int = 1) -> list[dict]:
    """BLEU, chrF and sentences/s of the whole test split with beam 4 for each `(config, workdir)`,
    each measured in a fresh process, `parallel` at once (`test.json`, read back once written; its
    speed is the device's share, where several decoded at once)."""
    pending = [(c, w) for c, w in runs if not (w / "test.json").exists()]
    at_once = min(max(1, parallel), len(pending))
    in_fresh_processes([(write_test_scores, c, w, at_once) for c, w in pending], parallel)
    for _, workdir in runs:
        # stopped by a signal
        if not (workdir / "test.json").exists():
            sys.exit(f"stopped while decoding the test split of {workdir}: the same command decodes it again")
    return [json.loads((workdir / "test.json").read_text()) for _, workdir in runs]


def write_test_scores(config, workdir: Path, at_once: int = 1) -> None:
    """`test.json`: the scores, the speed and the device, and how many decodings shared it."""
    import jax

    path = workdir / "test.json"
    run = prepare_run(compatibility.as_the_run_began(parse(config), workdir), workdir, training=False)
    _, params = run.restore_params()
    run.checkpoints.close()
    evaluator = evaluation.Evaluator(run)
    # compiles the loss pass and the search
    evaluation.evaluate_split(evaluator, params, "test", max_decoded=1)
    start = time.perf_counter()
    results, decoded = evaluation.evaluate_split(evaluator, params, "test")
    seconds = time.perf_counter() - start
    # the best hypothesis of each test sentence, by record index: the figure's buckets and the
    # paired bootstrap read them
    hypotheses = json.dumps(evaluation.best_hypotheses(decoded), ensure_ascii=False)
    files.write_whole(workdir / "test_hypotheses.json", lambda temporary: temporary.write_text(hypotheses))
    measured = {
        "bleu": results["bleu"],
        "chrf": results["chrf"],
        "sentences": len(decoded),
        "sentences_per_second": len(decoded) / seconds,
        "device": jax.devices()[0].device_kind,
        "decoded_at_once": at_once,
    }
    files.write_whole(path, lambda temporary: temporary.write_text(json.dumps(measured, indent=2)))


def parameter_count(config, workdir: Path) -> int:
    """The column's parameters, with the run's own vocabulary (preflight's count: abstract builds)."""
    settings = compatibility.as_the_run_began(parse(config), workdir)
    tokens = vocabularies.load_or_train(workdir / "tokenizer", settings.tokenizer)
    return preflight.parameter_count(settings.model.name, model_fields(settings, tokens))


def split_target_tokens(config, workdir: Path) -> int:
    """The training split's target tokens (eos included) in the run's own vocabulary: what one epoch
    trains on, a packed Transformer's and a bucketed RNN's alike."""
    settings = compatibility.as_the_run_began(parse(config), workdir)
    tokens = vocabularies.load_or_train(workdir / "tokenizer", settings.tokenizer)
    task = tasks.load_task(settings.task.name, settings.task.data_dir, **settings.task.params)
    return sum(len(tokens.target.encode(task.pair(record)[1])) + 1 for record in task.splits["train"])


def copy_scores(config) -> dict:
    """BLEU and chrF of the test split's sources taken as their own translations, scored as the
    models' outputs are (`score_registry.text_scores`): KJV and WEB share most of their words, so this is
    the floor a model has to clear before it has learnt anything of the translation."""
    settings = parse(config)
    task = tasks.load_task(settings.task.name, settings.task.data_dir, **settings.task.params)
    records = task.splits["test"]
    indices = range(len(records))
    sources = [task.pair(records[i])[0] for i in indices]
    return score_registry.text_scores(
        task.metric, sources, task.references("test", indices), bleu_tokenize=settings.evaluation.bleu_tokenize
    )


def final_runs(column: str, chosen: dict, seeds: int, workdir: Path) -> list[tuple[float, int, Path]]:
    """`(rate, seed, run folder)` of the column's runs of the full budget: the tuned rate at seeds
    0 .. seeds - 1, then a runner-up tied in tuning (`finalists`) at seed 0."""
    tuned, *tied = finalists(chosen)
    folder = lambda seed: workdir / column / ("final" if seed == 0 else f"final_seed{seed}")  # noqa: E731
    return [(tuned, seed, folder(seed)) for seed in range(seeds)] + [
        (rate, 0, workdir / column / f"final_{rate:g}") for rate in tied
    ]


@dataclasses.dataclass(frozen=True)
class Row:
    """One run of the budget, trained and decoded."""

    column: str
    seed: int
    rate: float
    tuned: bool
    plan: dict
    trained: dict
    epochs: float
    test: dict
    parameters: int
    workdir: Path

    @property
    def rate_label(self) -> str:
        if not self.tuned:
            return f"{self.rate:g} (runner-up: tied in tuning)"
        edge = " (the grid's edge)" if self.plan["best_at_edge"] else ""
        return f"{self.rate:g}{edge}"


def main() -> None:
    command_line.parse(FLAGS, sys.argv, __doc__)
    # as train.py's runs: the allocator, the collector and the compilation cache
    train_py.set_up_process()
    args = FLAGS
    columns = args.columns.split(",")
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise SystemExit(f"--columns: unknown {', '.join(unknown)}; valid: {', '.join(COLUMNS)}")
    plans = {column: plan(column, args) for column in columns}
    runs = [
        (column, *run)
        for column in columns
        for run in final_runs(column, plans[column], args.seeds, Path(args.workdir))
    ]
    # the finished runs first, read at once (a group of their own, whatever its size: none takes a place
    # beside a run that trains); then every column's first seed before any column's second: a stopped
    # benchmark has whole rows to show
    runs.sort(key=lambda run: (not (run[3] / "test.json").exists(), run[2]))
    finished = sum((workdir / "test.json").exists() for *_, workdir in runs)
    configs = [
        (column_config(column, rate, plans[column]["steps"], args.data_dir, seed), workdir)
        for column, rate, seed, workdir in runs
    ]
    # a stopped benchmark still has whole rows: each group of parallel runs is trained, then decoded
    rows = []
    group = max(1, args.parallel_runs)
    starts = [0, *range(finished, len(runs), group)] if finished else range(0, len(runs), group)
    for start, end in zip(starts, [*starts[1:], len(runs)]):
        chunk = list(zip(runs[start:end], configs[start:end]))
        trained = train_all([config for _, config in chunk], args.parallel_runs)
        tests = scores_on_test_split([config for _, config in chunk], args.parallel_runs)
        for ((column, rate, seed, workdir), (config, _)), run_trained, test in zip(chunk, trained, tests):
            chosen = plans[column]
            epochs = run_trained["target_tokens"] / split_target_tokens(config, workdir)
            parameters = parameter_count(config, workdir)
            tuned = rate == chosen["learning_rate"]
            rows.append(Row(column, seed, rate, tuned, chosen, run_trained, epochs, test, parameters, workdir))
    rows.sort(key=lambda row: (columns.index(row.column), not row.tuned, row.seed))
    print_runs(rows, args)
    if rows:
        config = column_config(columns[0], None, 1, args.data_dir)
        floor = copy_scores(config)
        print(f"| {COPIED} (no model) | | | | | | | | {floor['bleu']:.2f} | {floor['chrf']:.2f} | | |")
        texts = test_texts(config)
        print_seed_summary(rows, texts)
        print_and_draw_by_length(rows, texts, Path(args.figure))


def print_runs(rows: list[Row], args) -> None:
    """The table of every run."""
    print(
        f"kjv_web, {args.minutes:g} minutes of training each (steps from each family's speed); "
        f"test split ({rows[0].test['sentences'] if rows else 0} verses), beam {BEAM}"
    )
    print(
        "| model | seed | parameters | learning rate (tuned) | steps | epochs | train min | dev loss | test BLEU "
        "| test chrF | decode sentences/s | trained on; decoded on |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(
            f"| {row.column} | {row.seed} | {row.parameters / 1e6:.1f} M | {row.rate_label} | {row.plan['steps']:,} "
            f"| {row.epochs:.1f} | {row.trained['train_seconds'] / 60:.1f} | {row.trained['dev_loss']:.3f} "
            f"| {row.test['bleu']:.2f} | {row.test['chrf']:.2f} | {decode_speed(row.test)} "
            f"| {trained_on(row.workdir)}; {row.test.get('device', '?')} |"
        )


def decode_speed(test: dict) -> str:
    """Sentences/s of the test decoding, marked where others ran beside it (a share of the device)."""
    shared = test.get("decoded_at_once", 1)
    return f"{test['sentences_per_second']:.1f}" + (f" ({shared} started together)" if shared > 1 else "")


def test_texts(config) -> tuple[list[str], list[str], str]:
    """The test split's sources and references, by record index, and the BLEU tokenizer the runs use."""
    settings = parse(config)
    task = tasks.load_task(settings.task.name, settings.task.data_dir, **settings.task.params)
    indices = range(len(task.splits["test"]))
    sources = [task.pair(task.splits["test"][i])[0] for i in indices]
    references = [r if isinstance(r, str) else r[0] for r in task.references("test", indices)]
    return sources, references, settings.evaluation.bleu_tokenize


def hypotheses_of(row: Row, count: int) -> list[str]:
    """The run's best hypothesis of each test sentence, by record index (`test_hypotheses.json`)."""
    by_index = dict(json.loads((row.workdir / "test_hypotheses.json").read_text()))
    return [by_index[i] for i in range(count)]


def seeds_by_column(rows: list[Row]) -> dict[str, list[Row]]:
    """Each column's runs of its tuned rate, in the order of their seeds."""
    by_column: dict[str, list[Row]] = {}
    for row in sorted(rows, key=lambda row: row.seed):
        if row.tuned:
            by_column.setdefault(row.column, []).append(row)
    return by_column


def print_seed_summary(rows: list[Row], texts: tuple[list[str], list[str], str]) -> None:
    """Mean and standard deviation over seeds of test BLEU and chrF per column, ranked by mean BLEU,
    and the paired bootstrap (sacrebleu's) of each column against the leader and against the column
    ranked just above it (which says whether neighbours in the ranking are told apart), seed k
    against seed k (the seeds both have): the largest p-value of the seeds (a gap is called real
    only where every seed's is), marked "order varies" where some seed ranks the two the other way
    in that score and "reversed" where every seed does (the ranking is by BLEU)."""
    _, references, tokenize = texts
    by_column = seeds_by_column(rows)
    mean = {column: statistics.mean(row.test["bleu"] for row in runs) for column, runs in by_column.items()}
    ranked = sorted(by_column, key=mean.get, reverse=True)
    score_of = {"bleu_p": "bleu", "chrf_p": "chrf"}  # each p-value's score in test.json
    no_test = dict.fromkeys(score_of, "")

    def largest_p(better: str, column: str) -> dict[str, str]:
        by_seed = {row.seed: row for row in by_column[column]}
        pairs = [(best, by_seed[best.seed]) for best in by_column[better] if best.seed in by_seed]
        tests = [
            significance.paired_bootstrap(
                hypotheses_of(best, len(references)), hypotheses_of(row, len(references)), references, tokenize=tokenize
            )
            for best, row in pairs
        ]
        # sacrebleu's p says the gap is unlikely by chance, not which side it is on
        cells = {}
        for name, score in score_of.items():
            reversed_seeds = sum(row.test[score] > best.test[score] for best, row in pairs)
            order = {0: "", len(pairs): " (reversed)"}.get(reversed_seeds, " (order varies)")
            cells[name] = f"{max(t[name] for t in tests):.4f}{order}"
        return cells

    print(
        f"\nSeeds: mean (standard deviation) of the tuned rate's runs; paired bootstrap (the largest p of the "
        f"seeds) against the leader, {ranked[0]}, and against the column ranked just above"
    )
    print("| model | seeds | test BLEU | test chrF | BLEU p, leader | chrF p, leader | BLEU p, above | chrF p, above |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for rank, column in enumerate(ranked):
        runs = by_column[column]
        bleu, chrf = [row.test["bleu"] for row in runs], [row.test["chrf"] for row in runs]
        spread = lambda values: statistics.stdev(values) if len(values) > 1 else math.nan  # noqa: E731
        against_leader = largest_p(ranked[0], column) if rank else no_test
        # the second's column above is the leader: its test is already in the leader's cells
        against_above = largest_p(ranked[rank - 1], column) if rank > 1 else no_test
        print(
            f"| {column} | {len(runs)} | {statistics.mean(bleu):.2f} ({spread(bleu):.2f}) "
            f"| {statistics.mean(chrf):.2f} ({spread(chrf):.2f}) "
            f"| {against_leader['bleu_p']} | {against_leader['chrf_p']} "
            f"| {against_above['bleu_p']} | {against_above['chrf_p']} |"
        )


def print_and_draw_by_length(rows: list[Row], texts: tuple[list[str], list[str], str], figure: Path) -> None:
    """Bahdanau et al.'s figure 2 on the test split: corpus BLEU of each bucket of 10 source words per
    column (its seeds' outputs scored as one corpus, sentence by sentence), with the 95% bootstrap
    interval (resampling the bucket's sentences); printed as a table and drawn into `figure`, beside
    the source copied as its own translation (the floor, bucket by bucket, against `test_texts`'
    references). In the figure the columns sit side by side within a bucket, and buckets of fewer
    than `FEW_SENTENCES` sentences are hollow points off the lines."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    sources, references, tokenize = texts
    lengths = [len(source.split()) for source in sources]
    by_column = {
        column: significance.bleu_by_length(
            sum(
                significance.sentence_statistics(hypotheses_of(row, len(references)), references, tokenize)
                for row in runs
            ),
            lengths,
            tokenize=tokenize,
        )
        for column, runs in seeds_by_column(rows).items()
    }
    by_column[COPIED] = significance.bleu_by_length(
        significance.sentence_statistics(sources, references, tokenize), lengths, tokenize=tokenize
    )
    buckets = next(iter(by_column.values()))
    print("\nBLEU by source length (words), the seeds' outputs together; [95% bootstrap interval]")
    print("| source words | sentences | " + " | ".join(by_column) + " |")
    print("|---|---:|" + "---:|" * len(by_column))
    for k, bucket in enumerate(buckets):
        cells = [
            f"{scores[k].bleu:.1f} [{scores[k].interval[0]:.1f}, {scores[k].interval[1]:.1f}]"
            if scores[k].bleu is not None
            else ""
            for scores in by_column.values()
        ]
        print(f"| {bucket.low}-{bucket.high} | {bucket.sentences} | " + " | ".join(cells) + " |")
    figure.parent.mkdir(parents=True, exist_ok=True)
    axes = pyplot.figure(figsize=(7.5, 4.5)).add_subplot()
    for k, (column, scores) in enumerate(by_column.items()):
        # side by side within a bucket, 0.6 words apart, so that the intervals do not hide one another
        shift = (k - (len(by_column) - 1) / 2) * 0.6
        style = {"color": "gray", "linestyle": "--"} if column == COPIED else {"color": f"C{k}"}
        label = {"label": column}
        for few in (False, True):
            shown = [b for b in scores if b.bleu is not None and (b.sentences < FEW_SENTENCES) == few]
            if not shown:
                continue
            axes.errorbar(
                [(b.low + b.high) / 2 + shift for b in shown],
                [b.bleu for b in shown],
                yerr=[[b.bleu - b.interval[0] for b in shown], [b.interval[1] - b.bleu for b in shown]],
                marker="o",
                capsize=2,
                # a bucket of a few sentences is a point of its own, not a step of the line
                **({**style, "linestyle": "none", "fillstyle": "none"} if few else style),
                # the legend names each column once, on whichever is drawn first
                **label,
            )
            label = {}
    for bucket in buckets:
        axes.annotate(
            f"n={bucket.sentences}", ((bucket.low + bucket.high) / 2, 0), ha="center", va="bottom", fontsize=7
        )
    axes.set_xlabel("source sentence length (words, buckets of 10)")
    axes.set_ylabel("BLEU of the bucket's sentences")
    axes.set_title(
        f"kjv_web test split: BLEU by source length (Bahdanau et al., figure 2)\n"
        f"hollow: buckets of fewer than {FEW_SENTENCES} sentences",
        fontsize=10,
    )
    axes.set_ylim(bottom=0)
    # beside the axes: inside, it hid the short buckets' points
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes.figure.savefig(figure, dpi=120, bbox_inches="tight")
    print(f"\nfigure: {figure}")


if __name__ == "__main__":
    from utils import allocator

    # as train.py runs (the imports above are paid twice)
    allocator.restart_with_huge_pages(__file__)
    main()
