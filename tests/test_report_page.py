"""report/pages.py: the run's and the sweep's pages, read from the run folder, checked in headless Chromium.

The browser tests open the pages from disk in Debian's `chromium` driven by Playwright (one browser
for the module) and skip, naming what is missing, where either is absent.
"""

import base64
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from models.attention import AttentionRole
from report import pages, pictures
from run_setup import input_kinds

CHROMIUM = Path("/usr/bin/chromium")


# ----------------------------------------------------------------------------- reading and writing, no browser


@pytest.mark.curves
def test_damaged_metrics_lines_are_skipped_and_counted(tmp_path):
    good = {"step": 5, "split": "train", "loss": 2.5, "learning_rate": 1e-3}
    lines = [
        json.dumps(good),
        '{"step": 10, "split": "tr',
        "[1, 2]",
        "",
        json.dumps({"step": 10, "split": "dev", "loss": 2.0}),
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rows, damaged = pages.read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [good, {"step": 10, "split": "dev", "loss": 2.0}] and damaged == 2
    page = pages.write(tmp_path).read_text()
    assert "2 damaged line(s) of metrics.jsonl skipped" in page
    # no eval/ folder: the page says so
    assert "No evaluation yet" in page
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.curves
def test_a_run_with_nothing_written_yet_has_a_page(tmp_path):
    page = pages.write(tmp_path).read_text()
    assert "No evaluation yet" in page and "No metrics logged yet" in page
    assert not (tmp_path / "curves.png").exists()


def test_curve_series_by_metric_and_split():
    rows = [
        {"step": 0, "split": "data", "train_examples": 600},
        {"step": 5, "split": "train", "loss": 3.0, "learning_rate": 0.1, "alignment_accuracy/m": 0.5},
        {"step": 10, "split": "dev", "loss": 2.0, "exact_match": 0.25, "decoded_examples": 24},
        {"step": 10, "split": "dev", "loss": 1.5, "mode": "eval"},
    ]
    series = pages.curve_series(rows)
    assert list(series) == ["loss", "learning_rate", "exact_match"]
    assert series["loss"] == {"train": [(5, 3.0)], "dev": [(10, 2.0)], "dev (eval mode)": [(10, 1.5)]}


def test_packed_keeps_each_rows_largest_weights():
    weights = np.array([[[0.1, 0.6, 0.3], [0.5, 0.0, 0.4]]])  # [N=1, Tq=2, Tk=3]
    values = pages.quantized(weights)
    # round(w * 255)
    np.testing.assert_array_equal(values, [[[26, 153, 76], [128, 0, 102]]])
    assert pages.packed_weights(values, None) == values.tobytes()
    kept = pages.packed_weights(values, 2)
    positions = np.frombuffer(kept[:8], "<u2").reshape(1, 2, 2)
    # as the page rebuilds a row: the kept weights at their positions, 0 elsewhere
    shown = np.zeros_like(values)
    np.put_along_axis(shown, positions.astype(np.int64), np.frombuffer(kept[8:], np.uint8).reshape(1, 2, 2), axis=-1)
    np.testing.assert_array_equal(shown, [[[0, 153, 76], [128, 0, 102]]])


def test_attention_payload_halves_the_kept_weights_until_it_fits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 16, 64))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    examples = [
        {
            "name": "e",
            "source": ["a"] * 64,
            "output": ["b"] * 16,
            "modules": [{"name": "m", "role": "cross", "weights": weights}],
        }
    ]
    _, blobs, keep = pages.attention_payloads(examples)
    assert keep is None and len(zlib.decompress(base64.b64decode(blobs[0]))) == weights.size
    described, blobs, keep = pages.attention_payloads(examples, budget=300)
    deflated = len(base64.b64decode(blobs[0]))
    assert keep is not None and keep < 64 and (deflated <= 300 or keep == 1)
    assert described[0]["modules"][0]["keep"] == keep


def test_a_feature_grid_example_is_explored_over_its_cells(tmp_path):
    weights = {"attention": np.array([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]], np.float32)}  # [N=1, T=2, L=3]
    features = input_kinds.KINDS["features"]
    features.draw(
        tmp_path / "attention" / "step_1",
        "example_0",
        np.zeros((3, 4), np.float32),
        weights,
        {"attention": AttentionRole.CROSS},
        ["a", "</s>"],
        None,
        None,
    )
    (example,) = pages.read_run(tmp_path).attention
    assert example["source"] == ["cell 0", "cell 1", "cell 2"] and example["output"] == ["a", "</s>"]
    assert [(m["name"], m["role"]) for m in example["modules"]] == [("attention", "cross")]
    np.testing.assert_array_equal(example["modules"][0]["weights"], weights["attention"])


def test_every_evaluation_writes_the_report_and_its_inputs(finished_run):
    _, workdir, _ = finished_run
    page = (workdir / "report.html").read_text()
    assert "Attention explorer" in page and "http://" not in page.replace("http://www.w3.org", "")
    assert (workdir / "curves.png").exists()
    assert '<div id="run-summary">task dates, model transformer, 20 steps' in page
    assert (workdir / "predictions" / "step_20_dev.tsv").exists() and (
        workdir / "predictions" / "step_10_dev.tsv"
    ).exists()
    saved = np.load(workdir / "attention" / "step_20" / "example_0.npz")
    modules = saved["modules"].tolist()
    assert sorted(saved["roles"].tolist()) == ["cross", "source_self", "target_self"]
    assert dict(zip(modules, saved["roles"].tolist()))["decoder_layers/0/cross_attention"] == "cross"
    # the dates task's gold spans of this example
    assert saved["alignment"].shape == (3, 4)


def test_rebuilt_from_the_folder_alone(finished_run, tmp_path):
    _, workdir, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("checkpoints", "report.html"))
    assert pages.write(copy).read_text().count('class="example"') == 3


# ----------------------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package: `make chromium`)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright==1.63.0)"
    )
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


class OpenPage:
    """A page opened from disk, with what it logged and requested."""

    def __init__(self, browser, path: Path):
        self.page = browser.new_page()
        self.errors, self.requests = [], []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)

    def check_clean(self):
        assert self.errors == []
        # the page itself, nothing else
        assert self.requests == [self.url]

    def weights(self, selector: str) -> list[float]:
        return [float(w) for w in self.page.eval_on_selector_all(selector, "nodes => nodes.map(n => n.dataset.w)")]


def test_explorer_hover_shows_the_rows_weights(browser, finished_run):
    _, workdir, _ = finished_run
    saved = np.load(workdir / "attention" / "step_20" / "example_0.npz")
    cross = saved["decoder_layers_0_cross_attention"]  # [N, T, S]
    opened = OpenPage(browser, workdir / "report.html")
    page = opened.page
    explorer = page.locator("details.example").first.locator(".explorer")
    page.wait_for_selector("details.example .explorer[data-rendered]")
    assert explorer.locator("select.kind").input_value() == "cross"
    # the month: in the gold span (5, 7)
    target = 5
    assert len(saved["output_tokens"]) > target
    explorer.locator(".queries .tok").nth(target).hover()
    shown = opened.weights("details.example >> nth=0 >> .keys .tok")
    # head 0, uint8 on the page
    np.testing.assert_allclose(shown, cross[0, target], atol=0.5 / 255 + 1e-4)
    explorer.locator("select.head").select_option("1")
    explorer.locator(".queries .tok").nth(target).hover()
    shown_head_1 = opened.weights("details.example >> nth=0 >> .keys .tok")
    np.testing.assert_allclose(shown_head_1, cross[1, target], atol=0.5 / 255 + 1e-4)
    assert not np.allclose(shown, shown_head_1)
    # a source token: its column over the output
    explorer.locator(".keys .tok").nth(2).hover()
    np.testing.assert_allclose(
        opened.weights("details.example >> nth=0 >> .queries .tok"), cross[1, :, 2], atol=0.5 / 255 + 1e-4
    )
    explorer.locator("select.head").select_option("mean")
    explorer.locator(".queries .tok").nth(target).hover()
    np.testing.assert_allclose(
        opened.weights("details.example >> nth=0 >> .keys .tok"), cross.mean(0)[target], atol=0.5 / 255 + 1e-4
    )
    # the gold source span of the hovered output position is outlined
    spans = saved["alignment"]
    t0, t1, s0, s1 = next(span for span in spans if span[0] <= target < span[1])
    gold = explorer.locator(".keys .tok.gold")
    assert [int(i) for i in gold.evaluate_all("ns => ns.map(n => n.dataset.index)")] == list(
        range(s0, min(s1, len(saved["source_tokens"])))
    )
    explorer.locator("select.kind").select_option("source_self")
    explorer.locator(".queries .tok").nth(1).hover()
    np.testing.assert_allclose(
        opened.weights("details.example >> nth=0 >> .keys .tok"),
        saved["encoder_layers_0_self_attention"].mean(0)[1],
        atol=0.5 / 255 + 1e-4,
    )
    page.click("#worst-first")
    chrf = [float(t) for t in page.locator("#examples tbody tr td:nth-child(4)").all_text_contents()]
    assert chrf == sorted(chrf) and len(chrf) == 24
    opened.check_clean()
    page.close()


def test_image_explorer_and_sweep_page(browser, tmp_path):
    """A captioner's example (drawn as evaluation draws it) and a sweep's page, in one browser page each."""
    run = tmp_path / "trial_0"
    image = np.zeros((8, 16, 1), np.uint8)
    image[:, 4:8] = 255
    weights = np.full((3, 8), 0.02)  # [T, L]: 3 words over a 2 x 4 grid of 4 x 4 pixel cells
    weights[0, 1], weights[1, 6], weights[2, 0] = 0.86, 0.86, 0.86
    centres = np.array([[2 + 4 * c, 2 + 4 * r] for r in range(2) for c in range(4)])  # (x, y)
    # the words' boxes; cells 1 and 6 are inside
    boxes = np.array([[4, 0, 8, 4], [8, 4, 12, 8], [-1, -1, -1, -1]])
    extras = {"centres": centres, "boxes": boxes}
    pictures.draw_image_attention(
        run / "attention" / "step_5", "example_0", image, weights, (2, 4), ["one", "two", "</s>"], extras
    )
    opened = OpenPage(browser, pages.write(run))
    page = opened.page
    page.wait_for_selector("details.example .explorer[data-rendered]")
    assert page.locator("select.kind").input_value() == "grid"
    # word 0's cell 1 lies in its box
    assert "localisation accuracy: 1.000" in page.locator(".accuracy").inner_text()
    pixels = (
        "() => Array.from(document.querySelector('canvas.heatmap').getContext('2d')"
        ".getImageData(0, 0, 999, 999).data).join()"
    )
    before = page.evaluate(pixels)
    page.locator(".queries .tok").nth(0).hover()
    # the word's attention laid over the image
    assert page.evaluate(pixels) != before
    opened.check_clean()
    page.close()

    rows = [
        {"trial": 1, "state": "complete", "dev/score": 0.5, "lr": 0.01, "workdir": str(tmp_path / "trial_1")},
        {"trial": 0, "state": "complete", "dev/score": 0.25, "lr": 0.001, "workdir": str(run)},
        {"trial": 2, "state": "fail", "dev/score": None, "lr": 0.1, "workdir": ""},
    ]
    opened = OpenPage(browser, pages.write_sweep(tmp_path, rows, "dev/score", {"lr": ("log_uniform", 1e-4, 1.0)}))
    page = opened.page
    page.click("#trials th:has-text('dev/score')")
    # ascending, the failed trial last
    assert page.locator("#trials tbody tr td:nth-child(1)").all_text_contents() == ["0", "1", "2"]
    page.click("#trials th:has-text('dev/score')")
    assert page.locator("#trials tbody tr td:nth-child(1)").all_text_contents() == ["1", "0", "2"]
    assert page.locator("#trials a", has_text="0").get_attribute("href") == "trial_0/report.html"
    # by trial, by lr
    assert page.locator("svg.chart").count() == 2
    opened.check_clean()
    page.close()


# Tiny, as tests/test_model_interface.py builds them. The RNN families' single-head cross-attention
# takes the Transformer's path (test_explorer_hover_shows_the_rows_weights); building a model costs
# seconds, so only the LSTMN, whose intra-attention is a kind of its own, is built here.
FAMILIES = {"lstmn": dict(embed_dim=4, hidden_dim=6, attention_dim=5, max_length=8)}


def test_an_lstmn_gets_an_explorer_of_its_kinds(browser, tmp_path):
    """An LSTMN example saved as evaluation saves it: the page offers each of the model's attention
    kinds (its intra-attention as source and target self, its inter-attention as cross) and shows the
    hovered row of each module."""
    from flax import nnx

    import models
    from models.attention import attention_roles, capture_attention

    batch = {"inputs": np.array([[4, 5, 6, 2]]), "targets": np.array([[7, 8, 2]])}
    folder = tmp_path / "attention" / "step_1"
    folder.mkdir(parents=True)
    expected = {}
    for name, fields in FAMILIES.items():
        model = models.create_model(name, rngs=nnx.Rngs(0), vocab_size=9, **fields)
        roles = attention_roles(model)
        weights = pictures.example_weights(capture_attention(model, batch), roles, 0, 4, 3)
        pictures.save_weights(folder / f"{name}.npz", weights, roles, ["a", "b", "c", "</s>"], ["x", "y", "</s>"])
        expected[name] = (sorted({r.value for r in roles.values()}), weights)
    assert expected["lstmn"][0] == ["cross", "source_self", "target_self"]
    opened = OpenPage(browser, pages.write(tmp_path))
    page = opened.page
    for number, name in enumerate(sorted(FAMILIES)):
        details = page.locator("details.example").nth(number)
        # the first opens by itself
        details.locator("summary").click() if number else None
        page.wait_for_selector(f"details.example >> nth={number} >> .explorer[data-rendered]")
        explorer = details.locator(".explorer")
        kinds = explorer.locator("select.kind option").evaluate_all("os => os.map(o => o.value)")
        assert sorted(kinds) == expected[name][0], name
        for kind in kinds:
            explorer.locator("select.kind").select_option(kind)
            module = explorer.locator("select.layer option").first.text_content()
            explorer.locator(".queries .tok").nth(1).hover()
            np.testing.assert_allclose(
                opened.weights(f"details.example >> nth={number} >> .keys .tok"),
                expected[name][1][module][0, 1],
                atol=0.5 / 255 + 1e-4,
                err_msg=f"{name} {module}",
            )
    opened.check_clean()
    page.close()


# What users' corpora, run folders and sweeps may hold: markup that would run a script, a link that
# would, quotes and angle brackets everywhere, a right-to-left override, a 10,000-character token.
HOSTILE = (
    "</script><script>window.pwned=1</script>",
    '<img src=x onerror="window.pwned=1">',
    '<a href="javascript:window.pwned=1">javascript:window.pwned=1</a>',
    "\"'<>&\"'<>",
    "\u202eevil\u202c",
    "x" * 10_000,
)


def hostile_run(folder: Path) -> Path:
    """A run folder written by the writers evaluation uses (eval scores, predictions, an explorer's
    `.npz`, metrics.jsonl) with every `HOSTILE` string as a source, reference, hypothesis, token,
    config value and metric split, and the page written from it."""
    from utils import metric_writer

    tokens = list(HOSTILE)
    rows = [(text, text[::-1], f"{text} {other}") for text, other in zip(HOSTILE, reversed(HOSTILE))]
    metric_writer.write_predictions(folder / "predictions" / "step_4_dev.tsv", rows)
    metric_writer.write_eval(folder, 4, "dev", {"loss": 1.5, "bleu": 3.0, "bleu_signature": HOSTILE[0]})
    # each output token attends most to the source token at its own position
    weights = np.full((1, len(tokens), len(tokens)), 0.5 / (len(tokens) - 1))
    weights[0, np.arange(len(tokens)), np.arange(len(tokens))] = 0.5
    (folder / "attention" / "step_4").mkdir(parents=True)
    pictures.save_weights(
        folder / "attention" / "step_4" / "example_0.npz",
        {"decoder_layers/0/cross_attention": weights},
        {"decoder_layers/0/cross_attention": AttentionRole.CROSS},
        tokens,
        tokens,
    )
    (folder / "config.json").write_text(json.dumps({"task": {"name": HOSTILE[0]}, "note": HOSTILE[1]}))
    lines = [{"step": s, "split": split, "loss": 2.0 / s} for s in (2, 4) for split in ("train", HOSTILE[1])]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return pages.write(folder)


def assert_nothing_ran_or_was_injected(page) -> None:
    """No script of the hostile strings ran, and none of their markup became an element."""
    assert page.evaluate("typeof window.pwned") == "undefined"
    injected = (
        "Array.from(document.querySelectorAll('*')).filter(e => e.tagName === 'IMG'"
        " || Array.from(e.attributes).some(a => a.name.startsWith('on'))"
        " || (e.tagName === 'A' && (e.getAttribute('href') || '').startsWith('javascript:'))"
        " || (e.tagName === 'SCRIPT' && !e.type && e.textContent.includes('pwned'))).length"
    )
    assert page.evaluate(injected) == 0


def assert_shown_as_text(opened: OpenPage, strings) -> None:
    """No script ran and no element was injected; each string is in the page's text as it is."""
    page = opened.page
    assert_nothing_ran_or_was_injected(page)
    text = page.evaluate("document.body.innerText")
    for string in strings:
        assert string.replace("\u202e", "").replace("\u202c", "") in text.replace("\u202e", "").replace("\u202c", "")
    opened.check_clean()


def test_hostile_text_on_the_run_and_sweep_pages_stays_text(browser, tmp_path):
    # a folder name can hold neither "/" nor a closing tag, but quotes and an opening tag
    folder = tmp_path / 'run "quoted" \'single\' <b onmouseover="window.pwned=1">'
    opened = OpenPage(browser, hostile_run(folder))
    page = opened.page
    page.wait_for_selector("details.example .explorer[data-rendered]")
    # open every decoded example and the explorer's tokens, so that their text is in the page's text
    page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
    assert_shown_as_text(opened, [folder.name, *HOSTILE])
    # each where it belongs: the folder's name as the title, the config as JSON
    assert page.locator("h1").first.inner_text() == folder.name
    assert json.loads(page.locator("pre").first.inner_text())["task"]["name"] == HOSTILE[0]
    # still usable: the explorer shows the hovered token's row, the 10,000-character one too
    explorer = page.locator("details.example").first.locator(".explorer")
    for row in (5, 1):
        explorer.locator(".queries .tok").nth(row).hover()
        expected = [0.5 if key == row else 0.1 for key in range(len(HOSTILE))]
        assert opened.weights("details.example >> nth=0 >> .keys .tok") == pytest.approx(expected, abs=1 / 255)
    # and the decoded examples sort, worst sentence chrF first
    page.click("#worst-first")
    chrf = [float(t) for t in page.locator("#examples tbody tr td:nth-child(4)").all_text_contents()]
    assert len(chrf) == len(HOSTILE) and chrf == sorted(chrf)
    assert_nothing_ran_or_was_injected(page)
    page.close()

    sweep = tmp_path / "sweep <i onclick='window.pwned=1'> \"s\""
    sweep.mkdir()
    rows = [
        {"trial": 0, "state": "complete", "dev/loss": 1.0, HOSTILE[1]: HOSTILE[0], "workdir": str(folder)},
        {"trial": 1, "state": "fail", "dev/loss": None, HOSTILE[1]: HOSTILE[2], "error": HOSTILE[3], "workdir": ""},
        {"trial": 2, "state": "complete", "dev/loss": 0.5, HOSTILE[1]: HOSTILE[4], "error": HOSTILE[5], "workdir": ""},
    ]
    opened = OpenPage(browser, pages.write_sweep(sweep, rows, "dev/loss", {HOSTILE[1]: ("categorical", HOSTILE[:3])}))
    assert_shown_as_text(opened, [sweep.name, *HOSTILE])
    opened.page.click("#trials th:has-text('dev/loss')")
    # ascending, the failed trial last
    assert opened.page.locator("#trials tbody tr td:nth-child(1)").all_text_contents() == ["2", "0", "1"]
    assert_nothing_ran_or_was_injected(opened.page)
    opened.page.close()
