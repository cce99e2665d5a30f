"""What a run tells the researcher: metrics.jsonl, TensorBoard events, the console, and the
files of its evaluations (`eval/step_<N>.json`, `predictions/*.tsv`).

`metrics.jsonl` holds one JSON object per logged event with `step`, `split`
and the metric names. On resume, rows after the restored step are dropped (and
TensorBoard purges them), so a resumed run's log equals an uninterrupted one.
On an interactive terminal a progress line shows loss, learning rate, steps/s,
tokens/s and ETA; otherwise a plain log line is written every log interval.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

from utils import files
from utils.progress import _clock


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def read_jsonl(workdir: Path) -> list[dict]:
    """The rows of `workdir/metrics.jsonl` (none if it does not exist)."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keeps the rows of `path` with `step <= last_step` (the rest were written after the checkpoint)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


class Reporter:
    """Writes metrics of one process (the first; the others pass `enabled=False`)."""

    def __init__(self, workdir: Path, *, num_steps: int, start_step: int, enabled: bool = True, truncate: bool = True):
        self.enabled = enabled
        self.num_steps, self.start_step = num_steps, start_step
        self.interactive = sys.stderr.isatty()
        self.start_time = time.time()
        # progress lines so far
        self.intervals = 0
        self.jsonl = workdir / "metrics.jsonl"
        self.tensorboard = None
        if enabled:
            # rows after the checkpoint are written again (all of them on a fresh start)
            if truncate:
                truncate_jsonl(self.jsonl, start_step if start_step > 0 else -1)
            self.tensorboard = SummaryWriter(
                str(workdir / "tensorboard"), purge_step=start_step + 1 if truncate else None
            )

    def write(self, step: int, split: str, metrics: Mapping[str, Any]) -> None:
        """One event: a JSON row, TensorBoard scalars `split/name`, and for eval a log line."""
        if not self.enabled:
            return
        row = {"step": step, "split": split, **{k: v for k, v in metrics.items() if not isinstance(v, bool)}}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for name, value in _scalars(metrics).items():
            self.tensorboard.add_scalar(f"{split}/{name}", value, step)
        self.tensorboard.flush()
        if split != "train":
            self._line(
                f"step {step} {split}: " + ", ".join(f"{k} {v:.4g}" for k, v in _scalars(metrics).items()), final=True
            )

    def images(self, step: int, pictures: Mapping[str, Any]) -> None:
        """RGB `[H, W, 3]` pictures into TensorBoard, under `attention/<name>`."""
        if not self.enabled:
            return
        for name, pixels in pictures.items():
            self.tensorboard.add_image(f"attention/{name}", pixels, step, dataformats="HWC")
        self.tensorboard.flush()

    def progress(
        self, step: int, loss: float, learning_rate: float, tokens_per_second: float, steps_per_second: float
    ) -> None:
        """The progress line of a log interval; at the second one (the first has the compilation in
        it), the estimated time to the end is logged once."""
        if not self.enabled:
            return
        self.intervals += 1
        if self.intervals == 2:
            logging.info("%s", estimate_line(self.num_steps - step, steps_per_second))
        remaining = (self.num_steps - step) / max(steps_per_second, 1e-9)
        eta = _clock(remaining) if math.isfinite(remaining) else "?"
        width = 24
        done = int(width * step / max(self.num_steps, 1))
        bar = "#" * done + "." * (width - done)
        text = (
            f"[{bar}] step {step}/{self.num_steps} loss {loss:.4f} lr {learning_rate:.2e} "
            f"{steps_per_second:.2f} steps/s {tokens_per_second:,.0f} tok/s eta {eta}"
        )
        self._line(text, final=not self.interactive)

    def _line(self, text: str, *, final: bool) -> None:
        """A progress bar redrawn in place on a terminal; finished lines are logged (console and log.txt)."""
        if self.interactive:
            sys.stderr.write("\r\033[K" + ("" if final else text))
            sys.stderr.flush()
        if final or not self.interactive:
            logging.info(text)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def estimate_line(steps_left: int, steps_per_second: float) -> str:
    """`about H:MM:SS of training to the end (N steps at R steps/s ...)`; evaluations come on top."""
    if not steps_per_second > 0 or not math.isfinite(steps_per_second):
        return f"{steps_left:,} steps to the end (no rate measured yet)"
    return (
        f"about {_clock(steps_left / steps_per_second)} of training to the end ({steps_left:,} steps at "
        f"{steps_per_second:.2f} steps/s after compilation; evaluations add to it)"
    )


def write_eval(workdir: Path, step: int, split: str, results: dict) -> None:
    """Adds one split's results to `eval/step_<N>.json` (one file per step, keyed by split)."""
    path = workdir / "eval" / f"step_{step}.json"
    path.parent.mkdir(exist_ok=True)
    existing = json.loads(path.read_text()) if path.exists() else {"step": step}
    existing[split] = results
    text = json.dumps(existing, indent=2) + "\n"
    files.write_whole(path, lambda temporary: temporary.write_text(text))


def write_predictions(path: Path, rows: Sequence[tuple[str, str, str]]) -> None:
    """`source<TAB>reference<TAB>hypothesis` lines under a header (tabs inside a text become spaces)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["source\treference\thypothesis\n"] + [
        "\t".join(text.replace("\t", " ") for text in row) + "\n" for row in rows
    ]
    files.write_whole(path, lambda temporary: temporary.write_text("".join(lines), encoding="utf-8"))


def write_n_best(path: Path, rows: Sequence[tuple[str, Sequence[tuple[str, float]]]]) -> None:
    """`source<TAB>rank<TAB>score<TAB>hypothesis` lines, ranks from 1 (best) for each source."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["source\trank\tscore\thypothesis\n"] + [
        f"{source.replace(chr(9), ' ')}\t{rank}\t{score:.6f}\t{text.replace(chr(9), ' ')}\n"
        for source, hypotheses in rows
        for rank, (text, score) in enumerate(hypotheses, start=1)
    ]
    files.write_whole(path, lambda temporary: temporary.write_text("".join(lines), encoding="utf-8"))


@contextlib.contextmanager
def log_file(workdir: Path, enabled: bool = True) -> Iterator[None]:
    """While active, what is logged also goes to `workdir/log.txt` (appended: a resumed run continues it)."""
    path = workdir / "log.txt"
    # a sweep sends a trial's whole output there already
    if not enabled or _stderr_is(path):
        yield
        return
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def _stderr_is(path: Path) -> bool:
    try:
        return path.exists() and os.path.samefile(f"/proc/self/fd/{sys.stderr.fileno()}", path)
    except (OSError, ValueError, io.UnsupportedOperation):
        return False
