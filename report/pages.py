"""The run's report page (`report.html`: curves, the latest evaluation, decoded examples, an attention
explorer) and `curves.png`; and a sweep's page. A reader of the run folder plus a pure HTML writer:

    python -c 'from report import pages; pages.write("runs/default-...")'

rebuilds both from what the run wrote: `metrics.jsonl`, `eval/step_<N>.json`,
`predictions/step_<N>[_<split>].tsv` and `attention/step_<N>/*.npz`.

The page is one file that opens from disk and makes no request. The attention
weights, the bulk of it, travel as uint8 (weight * 255, rounded), deflated per
example and base64-encoded; the page inflates an example with the browser's own
`DecompressionStream` when it is opened. 50 examples of 128 tokens with 6 layers
of 8 heads are 50 * 6 * 8 * 128 * 128 = 39M numbers per attention kind, over
the ~10 MB the page may weigh (benchmarks/report_page_cost.py); so where the dense
bytes do not fit `ATTENTION_BUDGET_BYTES`, each row keeps only its k largest
weights (k halved until they fit) and the page says so. The `.npz` files keep
every weight. The page's script and style live in `assets/report.js` and `assets/report.css`,
inlined into each page.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from utils.files import write_whole

# `scoring.metrics` (JAX), `report.pictures` (matplotlib) and sacrebleu are imported by the functions of the run's
# page that use them, not here: a sweep's processes write the sweep's page (`write_sweep`) without them.

# deflated, before base64 (x 4/3): the page stays under ~10 MB
ATTENTION_BUDGET_BYTES = 7 * 2**20
ROLE_LABELS = {
    "cross": "cross",
    "source_self": "source self",
    "target_self": "target self",
    "grid": "grid over the image",
}
SERIES_SKIPPED = ("step", "split", "mode", "decoded_examples", "localized_words")
CURVE_ORDER = ("loss", "learning_rate", "tokens_per_second", "steps_per_second")


# ----------------------------------------------------------------------------- reading the run folder


@dataclasses.dataclass
class RunFolder:
    """What the report shows of a run, read from its folder."""

    name: str
    # metrics.jsonl
    rows: list[dict]
    # metrics.jsonl lines that are not JSON objects with a step and a split
    damaged_lines: int
    # the latest eval/step_<N>.json ({} before the first evaluation)
    evaluation: dict
    # the latest decoded examples: source, reference, hypothesis, chrf
    examples: list[dict]
    examples_file: str
    # the latest drawn examples (`read_attention_example`)
    attention: list[dict]
    attention_step: int | None
    # config.json ({} where absent or unreadable)
    config: dict = dataclasses.field(default_factory=dict)


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The rows of a metrics.jsonl and the count of damaged lines skipped (a killed writer may leave half a line)."""
    if not path.exists():
        return [], 0
    rows, damaged = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            damaged += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("split"), str):
            rows.append(row)
        else:
            damaged += 1
    return rows, damaged


def latest_step_path(folder: Path, pattern: str) -> tuple[int, Path] | None:
    """`(N, path)` of the highest step among `folder`'s entries named `pattern` (a regex whose group 1 is N)."""
    found = (
        [(int(m.group(1)), p) for p in folder.glob("*") if (m := re.fullmatch(pattern, p.name))]
        if folder.is_dir()
        else []
    )
    return max(found, key=lambda f: (f[0], f[1].name)) if found else None


def read_examples(workdir: Path) -> tuple[list[dict], str]:
    """The decoded examples of the latest step (dev's where there are several splits), with sentence chrF."""
    import sacrebleu

    latest = latest_step_path(workdir / "predictions", r"step_(\d+)(?:_dev)?\.tsv")
    if latest is None:
        latest = latest_step_path(workdir / "predictions", r"step_(\d+)(?:_\w+)?\.tsv")
    if latest is None:
        return [], ""
    lines = latest[1].read_text(encoding="utf-8").splitlines()[1:]
    examples = []
    for line in lines:
        fields = line.split("\t")
        if len(fields) != 3:
            continue
        source, reference, hypothesis = fields
        chrf = sacrebleu.sentence_chrf(hypothesis, [reference]).score
        examples.append({"source": source, "reference": reference, "hypothesis": hypothesis, "chrf": round(chrf, 2)})
    return examples, latest[1].name


def read_attention_example(path: Path) -> dict:
    """One drawn example's `.npz` as the page shows it: tokens, modules `{name, role, weights [N, Tq, Tk]}`,
    and where the task knows them the gold alignment spans or the boxes, with the example's accuracy."""
    from report import pictures
    from scoring import metrics

    with np.load(path) as saved:
        data = {key: saved[key] for key in saved.files}
    example: dict[str, Any] = {"name": path.stem}
    # the captioner: each word over the image's annotation grid
    if "image" in data:
        words = [str(w) for w in data["words"]]
        weights = np.asarray(data["weights"], np.float32)[None]  # [1, T, L]
        example.update(
            queries=words,
            keys=[],
            image=data["image"],
            grid=[int(g) for g in data["grid"]],
            modules=[{"name": "attention (mean over heads)", "role": "grid", "weights": weights}],
        )
        if "boxes" in data and "centres" in data:
            boxes = np.asarray(data["boxes"])
            example["boxes"] = boxes[boxes[:, 0] >= 0].tolist()
            words_before_eos = len([w for w in words if w != "</s>"])
            hits, total = metrics.localization_counts(weights[0], words_before_eos, boxes, data["centres"])
            example["accuracy"] = {"localisation accuracy": hits / total} if total else {}
        return example
    source, output = [str(t) for t in data["source_tokens"]], [str(t) for t in data["output_tokens"]]
    names = [str(m) for m in data["modules"]] if "modules" in data else [k for k in data if k not in NPZ_FIELDS]
    roles = [str(r) for r in data["roles"]] if "roles" in data else ["cross"] * len(names)
    example.update(source=source, output=output, modules=[])
    for name, role in zip(names, roles):
        example["modules"].append(
            {"name": name, "role": role, "weights": np.asarray(data[pictures.npz_key(name)], np.float32)}
        )
    if "alignment" in data:
        spans = np.asarray(data["alignment"])
        example["alignment"] = spans.tolist()
        example["accuracy"] = {
            f"alignment accuracy, {m['name']}": metrics.alignment_accuracy(m["weights"].mean(axis=0), spans)
            for m in example["modules"]
            if m["role"] == "cross"
        }
    return example


NPZ_FIELDS = ("source_tokens", "output_tokens", "modules", "roles", "alignment")


def read_run(workdir: str | Path) -> RunFolder:
    workdir = Path(workdir)
    rows, damaged = read_metrics(workdir / "metrics.jsonl")
    latest_eval = latest_step_path(workdir / "eval", r"step_(\d+)\.json")
    evaluation = json.loads(latest_eval[1].read_text()) if latest_eval else {}
    examples, examples_file = read_examples(workdir)
    latest_attention = latest_step_path(workdir / "attention", r"step_(\d+)")
    attention = []
    if latest_attention:
        paths = sorted(
            latest_attention[1].glob("*.npz"),
            key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.stem)],
        )
        attention = [read_attention_example(p) for p in paths]
    try:
        config = json.loads((workdir / "config.json").read_text())
    except (OSError, ValueError):
        # before the run wrote it, or damaged: the page goes without
        config = {}
    return RunFolder(
        workdir.name,
        rows,
        damaged,
        evaluation,
        examples,
        examples_file,
        attention,
        latest_attention[0] if latest_attention else None,
        config if isinstance(config, dict) else {},
    )


# ----------------------------------------------------------------------------- the curves


def curve_series(rows: Iterable[Mapping]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """`{metric: {split: [(step, value)]}}` of the numeric metrics, the training ones first. Rows of
    `--mode=eval` count as the split `<split> (eval mode)`; per-module metrics (names with "/") are left out."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in rows:
        split = row["split"] + (" (eval mode)" if row.get("mode") == "eval" else "")
        if split == "data":
            continue
        for name, value in row.items():
            if name in SERIES_SKIPPED or "/" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                series.setdefault(name, {}).setdefault(split, []).append((row["step"], float(value)))
    order = {name: i for i, name in enumerate(CURVE_ORDER)}
    return dict(sorted(series.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))


CURVE_PANEL_INCHES = (3.6, 2.6)


def write_curves(rows: Sequence[Mapping], path: Path) -> None:
    """`curves.png`: one panel per metric, a line per split (for a glance from a terminal session).
    Drawn once, with margins fixed in inches and about four ticks an axis: `tight_layout` would
    draw the figure twice, for twice the cost."""
    from report import pictures

    series = curve_series(rows)
    if not series:
        return
    columns = min(4, len(series))
    grid_rows = -(-len(series) // columns)
    panel_width, panel_height = CURVE_PANEL_INCHES
    width, height = panel_width * columns, panel_height * grid_rows
    figure = pictures.new_figure(figsize=(width, height))
    figure.subplots_adjust(
        left=0.5 / width,
        right=1 - 0.15 / width,
        bottom=0.45 / height,
        top=1 - 0.3 / height,
        wspace=0.55 / (panel_width - 0.65),
        hspace=0.75 / (panel_height - 0.75),
    )
    axes = figure.subplots(grid_rows, columns, squeeze=False)
    for axis in axes.flat[len(series) :]:
        axis.axis("off")
    for axis, (name, by_split) in zip(axes.flat, series.items()):
        for split, points in by_split.items():
            steps, values = zip(*points)
            axis.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=split)
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.locator_params(nbins=4)
        axis.grid(alpha=0.3)
        if len(by_split) > 1:
            axis.legend(fontsize=7)
    write_whole(path, lambda temporary: figure.savefig(temporary, dpi=pictures.PICTURE_DPI, format="png"))


# ----------------------------------------------------------------------------- SVG charts (no library)

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def svg_chart(
    title: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    lines: bool = True,
    log_x: bool = False,
    x_label: str = "step",
    x_ticks: Sequence[str] | None = None,
    links: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """An inline SVG of `series` ({label: [(x, y)]}), as lines or points; `x_ticks` names integer x
    positions (categories); `links` gives each point of a series a link (a trial's report)."""
    width, height, left, right, top, bottom = 330, 210, 52, 10, 22, 34
    points = [p for values in series.values() for p in values]
    if not points:
        return ""
    xs = [math.log10(x) if log_x else x for x, _ in points]
    ys = [y for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    x0, x1 = (x0 - 0.5, x1 + 0.5) if x0 == x1 else (x0, x1)
    y0, y1 = (y0 - abs(y0) * 0.1 - 1e-9, y1 + abs(y1) * 0.1 + 1e-9) if y0 == y1 else (y0, y1)

    def at(x: float, y: float) -> tuple[float, float]:
        x = math.log10(x) if log_x else x
        return left + (x - x0) / (x1 - x0) * (width - left - right), top + (1 - (y - y0) / (y1 - y0)) * (
            height - top - bottom
        )

    parts = [
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">',
        f'<text x="{width / 2}" y="14" text-anchor="middle" class="title">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" class="frame"/>',
    ]
    for fraction in (0.0, 0.5, 1.0):
        value = y0 + fraction * (y1 - y0)
        _, y = at(10**x0 if log_x else x0, value)
        parts.append(f'<text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end">{value:.3g}</text>')
    if x_ticks is not None:
        for position, label in enumerate(x_ticks):
            x, _ = at(position, y0)
            parts.append(
                f'<text x="{x:.1f}" y="{height - bottom + 12}" text-anchor="middle">{html.escape(label)}</text>'
            )
    else:
        for fraction in (0.0, 0.5, 1.0):
            value = x0 + fraction * (x1 - x0)
            x, _ = at(10**value if log_x else value, y0)
            parts.append(
                f'<text x="{x:.1f}" y="{height - bottom + 12}" text-anchor="middle">'
                f"{(10**value if log_x else value):.3g}</text>"
            )
    parts.append(f'<text x="{width / 2}" y="{height - 4}" text-anchor="middle">{html.escape(x_label)}</text>')
    for number, (label, values) in enumerate(series.items()):
        colour = COLOURS[number % len(COLOURS)]
        coordinates = [at(x, y) for x, y in values]
        if lines and len(coordinates) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coordinates)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        for index, ((x, y), (vx, vy)) in enumerate(zip(coordinates, values)):
            dot = (
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}">'
                f"<title>{html.escape(label)}: {vx:g}, {vy:.4g}</title></circle>"
            )
            href = links[label][index] if links and links.get(label) else ""
            parts.append(f'<a href="{html.escape(href)}">{dot}</a>' if href else dot)
        if len(series) > 1:
            parts.append(
                f'<text x="{left + 6}" y="{top + 12 + 11 * number}" style="fill: {colour}">{html.escape(label)}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


# ----------------------------------------------------------------------------- the attention data


def quantized(weights: np.ndarray) -> np.ndarray:
    """`[N, Tq, Tk]` weights in [0, 1] as uint8: round(w * 255)."""
    return np.clip(np.rint(np.asarray(weights, np.float32) * 255), 0, 255).astype(np.uint8)


def packed_weights(values: np.ndarray, keep: int | None) -> bytes:
    """uint8 weights `[N, Tq, Tk]` as the page reads them: all of them (`keep` None), or each row's
    `keep` largest (ties: any of them) as `[N, Tq, keep]` key positions (uint16 little-endian) then their values."""
    if keep is None or keep >= values.shape[-1]:
        return values.tobytes()
    # [N, Tq, keep]; linear, not a sort
    positions = np.argpartition(-values.astype(np.int16), keep - 1, axis=-1)[..., :keep]
    return positions.astype("<u2").tobytes() + np.take_along_axis(values, positions, axis=-1).tobytes()


def attention_payloads(
    examples: Sequence[dict], budget: int = ATTENTION_BUDGET_BYTES
) -> tuple[list[dict], list[str], int | None]:
    """Each example's page description (tokens, modules with their byte offsets) and its deflated,
    base64 weights; and the k largest weights kept per row (None: all), the most that fit `budget`."""
    keep: int | None = None
    longest = max((m["weights"].shape[-1] for e in examples for m in e["modules"]), default=0)
    # once, whatever k
    values = [[quantized(m["weights"]) for m in e["modules"]] for e in examples]
    while True:
        described, blobs, total = [], [], 0
        for example, example_values in zip(examples, values):
            description, chunks, offset = {k: v for k, v in example.items() if k not in ("modules", "image")}, [], 0
            description["modules"] = []
            for module, module_values in zip(example["modules"], example_values):
                data = packed_weights(module_values, keep)
                rows_kept = keep if keep is not None and keep < module["weights"].shape[-1] else None
                description["modules"].append(
                    {
                        "name": module["name"],
                        "role": module["role"],
                        "shape": list(module["weights"].shape),
                        "offset": offset,
                        "keep": rows_kept,
                    }
                )
                chunks.append(data)
                offset += len(data)
            if "image" in example:
                image = np.asarray(example["image"], np.uint8)
                description["image"] = {"shape": list(image.shape), "offset": offset}
                chunks.append(image.tobytes())
            deflated = zlib.compress(b"".join(chunks), 6)
            total += len(deflated)
            described.append(description)
            blobs.append(base64.b64encode(deflated).decode("ascii"))
        if total <= budget or keep == 1 or longest <= 1:
            return described, blobs, keep
        # Halve k, or go at once to the power of two the size suggests (a kept weight costs 3 bytes, not 1).
        current = longest if keep is None else keep
        guess = 2 ** int(math.log2(max(1.0, current * budget / total / (3 if keep is None else 1))))
        keep = max(1, min(current // 2, guess))


# ----------------------------------------------------------------------------- the page


def write(workdir: str | Path, *, curves: bool = True) -> Path:
    """Writes `workdir/report.html` and, with `curves`, `workdir/curves.png` (each whole or not at
    all); returns the page's path."""
    workdir = Path(workdir)
    folder = read_run(workdir)
    page = run_page(folder)
    path = workdir / "report.html"
    write_whole(path, lambda temporary: temporary.write_text(page, encoding="utf-8"))
    if curves:
        write_curves(folder.rows, workdir / "curves.png")
    return path


def draw_curves(workdir: str | Path) -> None:
    """`workdir/curves.png` from its metrics.jsonl, alone (the page untouched)."""
    rows, _ = read_metrics(Path(workdir) / "metrics.jsonl")
    write_curves(rows, Path(workdir) / "curves.png")


def run_page(folder: RunFolder) -> str:
    """The HTML of a run's report (pure: the folder's contents in, the page out)."""
    sections = [f"<h1>{html.escape(folder.name)}</h1>"]
    if folder.config:
        config = folder.config
        named = [
            f"{part} {config[part]['name']}"
            for part in ("task", "model")
            if isinstance(config.get(part), dict) and "name" in config[part]
        ]
        steps = [f"{config['num_train_steps']} steps" if "num_train_steps" in config else ""]
        sections.append(
            f'<div id="run-summary">{html.escape(", ".join(named + [s for s in steps if s]))}'
            "<details><summary>config.json</summary>"
            f"<pre>{html.escape(json.dumps(config, indent=2))}</pre></details></div>"
        )
    if folder.damaged_lines:
        sections.append(
            f'<p class="warning" id="damaged">{folder.damaged_lines} damaged line(s) of metrics.jsonl skipped.</p>'
        )
    series = curve_series(folder.rows)
    sections.append("<h2>Curves</h2>")
    charts = "".join(svg_chart(name, by_split) for name, by_split in series.items())
    sections.append(f'<div class="charts">{charts}</div>' if charts else "<p>No metrics logged yet.</p>")
    sections.append("<h2>Latest evaluation</h2>")
    if not folder.evaluation:
        sections.append(
            '<p class="empty" id="no-evaluation">No evaluation yet: '
            "this page fills in at the run's first evaluation.</p>"
        )
    else:
        sections.append(evaluation_table(folder.evaluation))
    described, blobs, keep = attention_payloads(folder.attention)
    if described:
        sections.append(f"<h2>Attention explorer <small>(step {folder.attention_step})</small></h2>")
        sections.append(
            '<p class="hint">Pick the kind, layer and head; hover an output token to see its weights over the keys, '
            "hover a key token for the reverse (colour: relative to the largest weight shown; "
            "the exact weight on hover). "
            "Gold spans are underlined in green, boxes drawn in green.</p>"
        )
        if keep is not None:
            sections.append(
                f'<p class="warning">To keep this page small, each row keeps its {keep} largest weights '
                "(the rest show as 0); "
                "the .npz files beside the pictures hold them all.</p>"
            )
        for number, example in enumerate(described):
            sections.append(
                f'<details class="example" data-example="{number}"><summary>{html.escape(example["name"])}: '
                f"{html.escape(tokens_as_text(example.get('output', example.get('queries', []))))}</summary>"
                '<div class="explorer"></div></details>'
            )
    if folder.examples:
        sections.append(
            f"<h2>Decoded examples <small>({html.escape(folder.examples_file)}, sentence chrF)</small></h2>"
        )
        sections.append(
            '<button id="worst-first">worst first</button> <span class="hint">click a column to sort</span>'
        )
        sections.append(examples_table(folder.examples))
    data = json.dumps({"examples": described}).replace("</", "<\\/")
    blob_tags = "".join(
        f'<script type="application/octet-stream" id="blob-{n}">{b}</script>' for n, b in enumerate(blobs)
    )
    return PAGE.format(
        title=html.escape(folder.name), style=STYLE, body="\n".join(sections), data=data, blobs=blob_tags, script=SCRIPT
    )


def tokens_as_text(tokens: Sequence[str]) -> str:
    """Tokens as text: SentencePiece pieces ("▁" starts a word) and characters joined, words spaced."""
    # <s>, </s>: specials
    if any("▁" in t for t in tokens) or all(len(t) <= 1 or t.startswith("<") and t.endswith(">") for t in tokens):
        return "".join(tokens).replace("▁", " ").strip()
    return " ".join(tokens)


def evaluation_table(evaluation: Mapping) -> str:
    """The latest `eval/step_<N>.json`: a column per split, a row per scalar metric."""
    splits = [s for s, v in evaluation.items() if isinstance(v, dict)]
    names = list(
        dict.fromkeys(
            n
            for s in splits
            for n, v in evaluation[s].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        )
    )
    head = "".join(f"<th>{html.escape(s)}</th>" for s in splits)
    body = "".join(
        f"<tr><td>{html.escape(n)}</td>"
        + "".join(f"<td>{format_number(evaluation[s].get(n))}</td>" for s in splits)
        + "</tr>"
        for n in names
    )
    return f'<p>step {evaluation.get("step")}</p><table id="evaluation"><tr><th>metric</th>{head}</tr>{body}</table>'


def format_number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else html.escape(str(value))


def examples_table(examples: Sequence[Mapping]) -> str:
    columns = ("source", "reference", "hypothesis", "chrf")
    head = "".join(f'<th data-column="{n}" data-numeric="{int(c == "chrf")}">{c}</th>' for n, c in enumerate(columns))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(e[c]))}</td>" for c in columns) + "</tr>" for e in examples)
    return (
        '<div class="scroll"><table id="examples" class="sortable">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


# ----------------------------------------------------------------------------- the sweep's page


def write_sweep(workdir: str | Path, rows: Sequence[Mapping], objective: str, space: Mapping[str, tuple]) -> Path:
    """`workdir/report.html` of a sweep: the trial table (sortable, each trial linked to its report), the
    objective against the trial and against each swept field. `rows`: `tuning.results.result_rows`."""
    workdir = Path(workdir)
    page = sweep_page(workdir, rows, objective, space)
    path = workdir / "report.html"
    write_whole(path, lambda temporary: temporary.write_text(page, encoding="utf-8"))
    return path


def sweep_page(workdir: Path, rows: Sequence[Mapping], objective: str, space: Mapping[str, tuple]) -> str:
    def link(row: Mapping) -> str:
        if not row.get("workdir"):
            return ""
        trial = Path(row["workdir"])
        try:
            trial = trial.relative_to(workdir) if trial.is_absolute() else trial
        except ValueError:
            trial = Path(trial.as_uri()[len("file://") :])
        return f"{trial}/report.html"

    done = sorted(
        (r for r in rows if r["state"] == "complete" and r.get(objective) is not None), key=lambda r: r["trial"]
    )
    charts = [
        svg_chart(
            f"{objective} by trial",
            {objective: [(r["trial"], r[objective]) for r in done]},
            lines=False,
            x_label="trial",
            links={objective: [link(r) for r in done]},
        )
    ]
    for name, kind in space.items():
        if kind[0] == "categorical":
            labels = [str(c) for c in kind[1]]
            points = [(labels.index(str(r[name])), r[objective]) for r in done if str(r.get(name)) in labels]
            charts.append(
                svg_chart(f"{objective} by {name}", {objective: points}, lines=False, x_label=name, x_ticks=labels)
            )
        else:
            points = [(r[name], r[objective]) for r in done if isinstance(r.get(name), (int, float))]
            charts.append(
                svg_chart(
                    f"{objective} by {name}",
                    {objective: points},
                    lines=False,
                    x_label=name,
                    log_x=kind[0] == "log_uniform",
                )
            )
    columns = [c for c in dict.fromkeys(k for r in rows for k in r) if c != "workdir"]
    numeric = {c: all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns}
    head = "".join(
        f'<th data-column="{n}" data-numeric="{int(numeric[c])}">{html.escape(c)}</th>' for n, c in enumerate(columns)
    )
    body = []
    for row in rows:
        cells = []
        for column in columns:
            text = format_number(row.get(column))
            if column == "trial" and link(row):
                text = f'<a href="{html.escape(link(row))}">{text}</a>'
            cells.append(f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    sections = [
        f"<h1>Sweep {html.escape(workdir.name)}</h1>",
        f"<p>{len(rows)} trials; objective {html.escape(objective)}.</p>",
        '<div class="charts">' + "".join(charts) + "</div>",
        "<h2>Trials</h2>",
        f'<table id="trials" class="sortable"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>',
    ]
    return PAGE.format(
        title=html.escape(f"sweep {workdir.name}"),
        style=STYLE,
        body="\n".join(sections),
        data=json.dumps({"examples": []}),
        blobs="",
        script=SCRIPT,
    )


# ----------------------------------------------------------------------------- the page's fixed parts

PAGE = (
    """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; """
    """style-src 'unsafe-inline'; img-src data: blob:">
<title>{title}</title><style>{style}</style></head>
<body>{body}
<script type="application/json" id="report-data">{data}</script>
{blobs}
<script>{script}</script>
</body></html>
"""
)

ASSETS = Path(__file__).resolve().parent / "assets"
STYLE = (ASSETS / "report.css").read_text(encoding="utf-8")
SCRIPT = (ASSETS / "report.js").read_text(encoding="utf-8")
