"""A corpus of WMT14's size through configs/kjv_web_transformer.py: time to the first step, memory, cache.

    python benchmarks/wmt_sized_corpus.py                  # 4.5M pairs, ~24 words a side (WMT14 en-de's size)
    python benchmarks/wmt_sized_corpus.py --pairs=200000   # a quick check

Makes a `.tsv` of `--pairs` pairs from the shipped corpus (data/kjv_web/train.tsv: its verses
as they are, then each further pair the first half of one verse joined to the second half of
another, on both sides; ~25 words a side like the verses), then runs train.py on it as a user
would (`--config.task.train=<the tsv>`, the shipped dev and test), twice, each in a fresh
process and workdir, and prints a table:

- cold: a fresh data_dir and an empty compilation cache: build the data, train the vocabulary,
  tokenize, compile, first step;
- warm: a new workdir, the same data_dir and compilation cache: everything is read back
  (`--warm_runs` of them, each in its own workdir: the median, and the largest peak);

for each, the seconds from the process's start to its first train step done (its log line), the
CPU seconds the process tree spent until then (on a machine shared with other work, wall time
/ CPU time says how much of the machine the run had), and
the peak resident memory of the whole process tree (train.py and the processes it starts),
sampled every 0.2 s, overall and up to its "step 0 data" line (the data ready, before compiling:
the train step's own buffers, GiBs, come after); then the size on disk of the built data and of the
tokenized cache beside it,
and the input pipeline's tokens/s (non-padding source + target tokens of the training batches,
read in this process from the warm run's cache, median over windows) against the train step's
consumption (the warm run's own tokens/s, median of its logged steps after the first two).
With `--floor` (the default), `../shared/peers/wmt_scale_floor.py` first runs on the same corpus in
this interpreter: what reading, SentencePiece, tokenizing and writing array_record cost with the
libraries alone, the floor the cold run is measured against.
Targets (issue 44): cold <= 1.5x the floor, warm <= 10 s, peak <= 2 GiB cold and warm.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from absl import app, flags

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

from benchmarks.pipeline_throughput import pipeline_rates  # noqa: E402

flags.DEFINE_integer("pairs", 4_500_000, "Pairs in the corpus's train split (WMT14 en-de: 4.5M).")
flags.DEFINE_integer(
    "steps", 12, "Train steps of each run: the first is timed, the later ones give the step's consumption."
)
flags.DEFINE_string(
    "folder", None, "Where the corpus, data_dir and workdirs go (default: a temporary folder, removed after)."
)
flags.DEFINE_integer("batches", 200, "Batches read to time the input pipeline.")
flags.DEFINE_integer(
    "warm_runs",
    3,
    "Warm runs, each in a new workdir: the table holds their median (the lower of two middles).",
    lower_bound=1,
)
flags.DEFINE_bool("floor", True, "Run ../shared/peers/wmt_scale_floor.py on the corpus first (the libraries alone).")
# the floor's phases, which add up to its total: "read", "vocabulary (10M chars)", "tokenize + write"
FLOOR_PHASE = re.compile(r"^(read|vocabulary.*?|tokenize \+ write)\s+([\d.]+) s .*peak RSS\s+(\d+) MiB", re.M)
FLAGS = flags.FLAGS

CONFIG = PROJECT_ROOT / "configs" / "kjv_web_transformer.py"
SHIPPED = PROJECT_ROOT / "data" / "kjv_web" / "train.tsv"
STEP_LINE = re.compile(r"step (\d+)/\d+ loss .* ([\d,.]+) tok/s")
DATA_LINE = re.compile(r"step 0 data: train_examples")
# utils/progress.py's closing line
PHASE_LINE = re.compile(r"\] (.+): done, ([\d,]+) (\S+) in (\d+):(\d\d):(\d\d)")


def write_corpus(path: Path, pairs: int) -> None:
    """`pairs` lines of `source<TAB>target` made from the shipped verses (see the module docstring)."""
    verses = [line.rstrip("\n").split("\t") for line in SHIPPED.read_text().splitlines() if line.count("\t") == 1]
    words = [(source.split(), target.split()) for source, target in verses]
    with open(path, "w") as file:
        for i in range(pairs):
            if i < len(words):
                source, target = words[i]
            else:
                first, second = words[i % len(words)], words[(i // len(words) * 7919 + i) % len(words)]
                source = first[0][: len(first[0]) // 2] + second[0][len(second[0]) // 2 :]
                target = first[1][: len(first[1]) // 2] + second[1][len(second[1]) // 2 :]
            file.write(" ".join(source) + "\t" + " ".join(target) + "\n")


def tree_rss(process: psutil.Process) -> int:
    """Resident bytes of a process and all its descendants."""
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def tree_cpu_seconds(process: psutil.Process) -> float:
    """User and system CPU seconds of a process, its ended children (waited for) and its live ones."""
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def timed_run(workdir: Path, data_dir: Path, corpus: Path, cache: Path, steps: int) -> dict:
    """train.py on the corpus in a fresh process: seconds to its first step, peak tree memory, and
    the tokens/s of its logged steps."""
    command = [
        sys.executable,
        "train.py",
        f"--config={CONFIG}",
        f"--workdir={workdir}",
        f"--config.task.train={corpus}",
        f"--config.data_dir={data_dir}",
        f"--config.num_train_steps={steps}",
        "--config.log_every_steps=1",
        "--config.eval_every_steps=1000000",
        "--config.checkpoint_every_steps=1000000",
        "--config.eval_decode_examples=8",
    ]
    environment = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    started = time.time()
    child = subprocess.Popen(
        command, cwd=PROJECT_ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    watched, peak, done = psutil.Process(child.pid), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], tree_rss(watched))
            except psutil.NoSuchProcess:
                return
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    first_step, rates, log, data_peak, phases = None, {}, [], float("nan"), []
    for line in child.stdout:
        log.append(line)
        phase = PHASE_LINE.search(line)
        if phase:
            hours, minutes, seconds = map(int, phase.groups()[3:])
            phases.append(
                f"{phase.group(1)} ({phase.group(2)} {phase.group(3)}): {3600 * hours + 60 * minutes + seconds} s"
            )
        # the data are ready (built, vocabulary, token ids); compiling comes next
        if DATA_LINE.search(line):
            data_peak = peak[0]
        found = STEP_LINE.search(line)
        if found:
            step = int(found.group(1))
            if first_step is None:
                first_step, first_step_cpu = time.time() - started, tree_cpu_seconds(watched)
            rates[step] = float(found.group(2).replace(",", ""))
            # the last step: what follows (final evaluation, report) is not measured
            if step >= steps:
                break
    done.set()
    sampler.join()
    # our own child and its workers
    for member in [*watched.children(recursive=True), watched]:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    child.wait()
    if first_step is None:
        raise SystemExit(f"train.py took no step; its output:\n{''.join(log[-40:])}")
    # the run's console, for a closer look
    (workdir.parent / f"{workdir.name}.log").write_text("".join(log))
    later = [rate for step, rate in rates.items() if step > 2]
    return {
        "first_step_s": first_step,
        "first_step_cpu_s": first_step_cpu,
        "peak_bytes": peak[0],
        "data_peak_bytes": data_peak,
        "train_tokens_per_s": statistics.median(later) if later else float("nan"),
        "phases": phases,
    }


def size_of(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def floor_seconds(corpus: Path) -> tuple[float, int]:
    """The floor script's seconds (its phases added up) and peak resident MiB on `corpus`."""
    script = PROJECT_ROOT.parent / "shared" / "peers" / "wmt_scale_floor.py"
    done = subprocess.run(
        [sys.executable, str(script), str(corpus), "--threads", "2"], capture_output=True, text=True, check=True
    )
    phases = FLOOR_PHASE.findall(done.stdout)
    if len(phases) != 3:
        raise SystemExit(f"{script} printed no phases I know:\n{done.stdout}\n{done.stderr}")
    return sum(float(seconds) for _, seconds, _ in phases), max(int(peak) for _, _, peak in phases)


def main(argv: list[str]) -> None:
    del argv
    root = Path(FLAGS.folder) if FLAGS.folder else Path(tempfile.mkdtemp(prefix="wmt_scale_"))
    root.mkdir(parents=True, exist_ok=True)
    corpus, data_dir, cache = root / "train.tsv", root / "tfds", root / "jax_cache"
    # cold means cold
    for stale in (data_dir, cache, root / "cold", *root.glob("warm*")):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        start = time.time()
        write_corpus(corpus, FLAGS.pairs)
        print(
            f"corpus: {FLAGS.pairs:,} pairs, {corpus.stat().st_size / 2**20:,.0f} MiB, "
            f"written in {time.time() - start:.0f} s",
            flush=True,
        )
        floor = floor_seconds(corpus) if FLAGS.floor else None
        cold = timed_run(root / "cold", data_dir, corpus, cache, FLAGS.steps)
        warms = [timed_run(root / f"warm{i}", data_dir, corpus, cache, FLAGS.steps) for i in range(FLAGS.warm_runs)]
        # the median run by time to the first step (the lower middle of an even count); the peaks the
        # largest of them all
        warm = {
            **sorted(warms, key=lambda run: run["first_step_s"])[(len(warms) - 1) // 2],
            "peak_bytes": max(run["peak_bytes"] for run in warms),
            "data_peak_bytes": max(run["data_peak_bytes"] for run in warms),
        }
        built = next(data_dir.glob("parallel_text/*/*/"))
        tokenized = size_of(built / "tokenized")
        data = size_of(built) - tokenized - size_of(built / "vocabularies")
        pipeline = pipeline_rates(
            CONFIG, [f"--config.task.train={corpus}", f"--config.data_dir={data_dir}"], FLAGS.batches, 20
        )
    finally:
        if not FLAGS.folder:
            shutil.rmtree(root, ignore_errors=True)
    gib = 2**30
    print(
        f"| {FLAGS.pairs:,} pairs | first step, s | CPU s to it (process tree) | peak memory, GiB (process tree) "
        "| of it, before compiling (the data) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, run in (
        ("cold: build, vocabulary, token ids, compile", cold),
        (f"warm: a new workdir, same data_dir (median of {len(warms)}; the largest peaks)", warm),
    ):
        print(
            f"| {name} | {run['first_step_s']:.0f} | {run['first_step_cpu_s']:.0f} | {run['peak_bytes'] / gib:.2f} "
            f"| {run['data_peak_bytes'] / gib:.2f} |"
        )
    for name, run in (("cold", cold), ("warm", warm)):
        print(f"{name}, the phases before the first step: {'; '.join(run['phases']) or 'none logged'}")
    if floor:
        seconds, peak_mib = floor
        print(
            f"\nthe floor (../shared/peers/wmt_scale_floor.py, the libraries alone): {seconds:.0f} s, "
            f"peak {peak_mib} MiB; cold / floor {cold['first_step_s'] / seconds:.2f} (target <= 1.5)"
        )
    peaks = ", ".join(f"{run['peak_bytes'] / gib:.2f}" for run in (cold, warm))
    each = ", ".join(f"{run['first_step_s']:.1f}" for run in warms)
    print(
        f"warm {warm['first_step_s']:.1f} s, the median of {each} (target <= 10); "
        f"peak cold, warm {peaks} GiB (target <= 2)"
    )
    print()
    print(f"on disk: built data {data / gib:.2f} GiB, token ids {tokenized / gib:.2f} GiB")
    print(
        f"input pipeline {pipeline['all_tokens_per_s']:,.0f} source+target tokens/s "
        f"({pipeline['target_tokens_per_s']:,.0f} target); "
        f"the train step consumes {warm['train_tokens_per_s']:,.0f} tokens/s (its log's tok/s): "
        f"{pipeline['target_tokens_per_s'] / warm['train_tokens_per_s']:.1f}x"
    )


if __name__ == "__main__":
    app.run(main)
