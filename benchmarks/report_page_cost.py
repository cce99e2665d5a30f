"""The report page's worst case: its size, the time to write it, and the time to open it in Chromium.

    python benchmarks/report_page_cost.py [--examples 50] [--tokens 128] [--layers 6] [--heads 8] [--repeats 3]

Builds a run folder whose latest evaluation drew `--examples` examples of a Transformer with
`--layers` encoder and decoder layers of `--heads` heads, source and output `--tokens` long: every
module's weights in the `.npz` as evaluation writes them (report.pictures.save_weights), 3 * layers *
heads * tokens^2 numbers per example (cross, source self, target self). The weights are softmaxes
of Gaussian logits (scale `--logit_scale`: the larger, the more peaked the heads and the better
their uint8 bytes compress; random logits compress worse than a trained model's structured heads),
plus a metrics.jsonl (a training run's metrics, each a panel of curves.png) and decoded examples. Then writes
report.html (report.pages.write), draws curves.png (report.pages.draw_curves: what training redraws at most
every `engine.training_loop.CURVES_EVERY_SECONDS`), and opens the page from disk in headless Chromium (Debian's,
via Playwright) `--repeats` times: the time until the page has loaded, and until the first
example's explorer has inflated its weights and drawn (the page opens it at once). Prints the medians.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

import numpy as np  # noqa: E402

from models.attention import AttentionRole  # noqa: E402
from report import (
    pages,  # noqa: E402
    pictures,  # noqa: E402
)

flags.DEFINE_integer("examples", 50, "drawn examples")
flags.DEFINE_integer("tokens", 128, "source and output length")
flags.DEFINE_integer("layers", 6, "encoder layers and decoder layers")
flags.DEFINE_integer("heads", 8, "heads per attention module")
flags.DEFINE_float("logit_scale", 3.0, "standard deviation of the Gaussian attention logits")
flags.DEFINE_integer("repeats", 3, "page openings (the medians are printed)")
flags.DEFINE_string("chromium", "/usr/bin/chromium", "the Chromium executable")
FLAGS = flags.FLAGS


def softmax_weights(
    rng: np.random.Generator, heads: int, queries: int, keys: int, scale: float, causal: bool
) -> np.ndarray:
    """`[N, Tq, Tk]` float32 rows of softmax(scale * Gaussian), zero above the diagonal when `causal`."""
    logits = rng.normal(size=(heads, queries, keys)) * scale
    if causal:
        logits = np.where(np.tril(np.ones((queries, keys), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)).astype(np.float32)


def build_run(workdir: Path) -> None:
    rng = np.random.default_rng(0)
    n, t = FLAGS.heads, FLAGS.tokens
    roles = {}
    for layer in range(FLAGS.layers):
        roles[f"encoder_layers/{layer}/self_attention"] = AttentionRole.SOURCE_SELF
        roles[f"decoder_layers/{layer}/self_attention"] = AttentionRole.TARGET_SELF
        roles[f"decoder_layers/{layer}/cross_attention"] = AttentionRole.CROSS
    folder = workdir / "attention" / "step_1000"
    folder.mkdir(parents=True)
    words = [f"w{i}" for i in range(t)]
    for example in range(FLAGS.examples):
        weights = {
            m: softmax_weights(rng, n, t, t, FLAGS.logit_scale, r is AttentionRole.TARGET_SELF)
            for m, r in roles.items()
        }
        pictures.save_weights(folder / f"example_{example}.npz", weights, roles, words, words)
    train = (
        "loss",
        "nll",
        "token_accuracy",
        "grad_norm",
        "update_norm",
        "param_norm",
        "learning_rate",
        "tokens_per_second",
        "steps_per_second",
    )
    # a training run's rows: one panel each in curves.png
    dev = ("loss", "perplexity", "token_accuracy", "bleu", "chrf", "exact_match")
    rows = [{"step": s, "split": "train", **{m: float(rng.random()) for m in train}} for s in range(100, 1001, 100)]
    rows += [{"step": s, "split": "dev", **{m: float(rng.random()) for m in dev}} for s in range(200, 1001, 200)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (workdir / "predictions").mkdir()
    lines = ["source\treference\thypothesis"] + [
        f"s {i}\tthe reference {i}\tthe hypothesis {i % 7}" for i in range(FLAGS.examples)
    ]
    (workdir / "predictions" / "step_1000_dev.tsv").write_text("\n".join(lines) + "\n")


def open_times(page_path: Path) -> list[tuple[float, float]]:
    """`(seconds to the load event, seconds to the first explorer drawn)` of each opening."""
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=FLAGS.chromium, args=["--no-sandbox"])
        for _ in range(FLAGS.repeats):
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            start = time.perf_counter()
            page.goto(page_path.as_uri(), wait_until="load", timeout=120_000)
            loaded = time.perf_counter() - start
            page.wait_for_selector("details.example .explorer[data-rendered]", timeout=120_000)
            drawn = time.perf_counter() - start
            if errors:
                raise RuntimeError(f"the page failed: {errors}")
            times.append((loaded, drawn))
            page.close()
        browser.close()
    return times


def main(argv: list[str]) -> None:
    del argv
    with tempfile.TemporaryDirectory() as temporary:
        workdir = Path(temporary) / "run"
        workdir.mkdir()
        build_run(workdir)
        start = time.perf_counter()
        path = pages.write(workdir, curves=False)
        written = time.perf_counter() - start
        start = time.perf_counter()
        pages.draw_curves(workdir)
        curves = time.perf_counter() - start
        described, _, keep = pages.attention_payloads(pages.read_run(workdir).attention)
        numbers = sum(int(np.prod(m["shape"])) for e in described for m in e["modules"])
        times = open_times(path)
        print(
            "| examples | tokens | layers x heads | weights | kept per row | page MB | write s | curves s | load s "
            "| first explorer s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        print(
            f"| {FLAGS.examples} | {FLAGS.tokens} | {FLAGS.layers} x {FLAGS.heads} | {numbers / 1e6:.1f}M "
            f"| {keep or 'all'} | {path.stat().st_size / 2**20:.2f} | {written:.1f} | {curves:.2f} "
            f"| {statistics.median(t[0] for t in times):.2f} | {statistics.median(t[1] for t in times):.2f} |"
        )


if __name__ == "__main__":
    app.run(main)
