"""Drawing only: attention heat maps with the key tokens along x and the query tokens along y.

For each attention module of an example (already cut to its real tokens), one
figure: every head and their mean. Which tokens go on which axis follows the
module's `AttentionRole`: cross-attention puts the source along x and the
output along y; self-attention the source (encoder) or the output (decoder)
along both. Beside the pictures, the weights themselves as `.npz` (with the
tokens), so they can be analysed without re-running the model.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot, no backend
switch), so importing this module leaves a notebook's inline plots alone.
The pictures of a run are made by `engine/evaluation.py` (at every evaluation) and
`inference.py` (`python inference.py --workdir=... --text "..."`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from models.attention import AttentionRole

# `models.attention` (JAX, flax) is imported by the functions that read a module's role, not here: a
# sweep's controller draws its objective's picture with this module and has no other use for JAX

# matplotlib is imported by the first picture drawn, not with this module: it is over a fifth of a
# training process's imports (`python -X importtime train.py --help`), and most processes that import
# this module draw nothing (a run's other processes, a run stopped before its first evaluation).


# pictures and curves.png
PICTURE_DPI = 90


def new_figure(**figure_args) -> Figure:
    """A matplotlib Figure drawn by the Agg canvas (files and pixels; no display, no pyplot state), at
    `PICTURE_DPI` unless `dpi` is given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**{"dpi": PICTURE_DPI, **figure_args})
    FigureCanvasAgg(figure)
    return figure


# heat-map geometry, in inches: a cell, a tick label's character at 7 points, the space of a
# panel's title and of the figure's; labels longer than LABEL_CHARACTERS are cut (the .npz keeps them whole)
CELL = 0.28
CHARACTER = 0.06
PANEL_TITLE = 0.3
FIGURE_TITLE = 0.45
PAD = 0.15
PANEL_GAP = 0.25
LABEL_CHARACTERS = 30


def tick_label(token: str) -> str:
    return token if len(token) <= LABEL_CHARACTERS else token[: LABEL_CHARACTERS - 1] + "\u2026"


def label_space(labels: Sequence[str]) -> float:
    """Inches beside an axis for its longest tick label, and a margin."""
    return PAD + CHARACTER * max(map(len, labels), default=1) + 0.1


def heatmaps(weights: np.ndarray, key_tokens: Sequence[str], query_tokens: Sequence[str], title: str) -> Figure:
    """One panel per head of `weights [N, Tq, Tk]` and a last panel of their mean, in rows of up to 3.

    The panels share their axes: the query tokens label the first column's y axes, the key tokens
    each column's lowest x axis. The layout is computed from the labels' lengths, not measured
    (matplotlib's `tight_layout` measured every label's text again and was half a picture's cost)."""
    panels = list(weights) + [weights.mean(axis=0)] if weights.shape[0] > 1 else [weights[0]]
    names = [f"head {n}" for n in range(weights.shape[0])] + ["mean over heads"] if len(panels) > 1 else ["attention"]
    columns = min(len(panels), 3)
    rows = -(-len(panels) // columns)
    x_labels, y_labels = [tick_label(t) for t in key_tokens], [tick_label(t) for t in query_tokens]
    # inches: each panel's plot, the left margin (y labels), each row's space below its plot (x labels)
    panel_width, panel_height = max(2.5, CELL * len(x_labels)), max(1.8, CELL * len(y_labels))
    left, below = label_space(y_labels), label_space(x_labels)
    width = left + columns * panel_width + (columns - 1) * PANEL_GAP + PAD
    height = FIGURE_TITLE + rows * (PANEL_TITLE + panel_height + below)
    figure = new_figure(figsize=(width, height))
    for index, (panel, name) in enumerate(zip(panels, names)):
        row, column = divmod(index, columns)
        x = left + column * (panel_width + PANEL_GAP)
        bottom = height - (FIGURE_TITLE + row * (PANEL_TITLE + panel_height + below) + PANEL_TITLE + panel_height)
        axis = figure.add_axes((x / width, bottom / height, panel_width / width, panel_height / height))
        axis.imshow(panel, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        # ticks only where they are labelled: each tick is a few artists to build and draw
        shown_x = x_labels if index + columns >= len(panels) else []
        shown_y = y_labels if column == 0 else []
        axis.set_xticks(range(len(shown_x)), shown_x, rotation=90, fontsize=7)
        axis.set_yticks(range(len(shown_y)), shown_y, fontsize=7)
        axis.set_title(name, fontsize=9)
    figure.suptitle(title, fontsize=10, y=1 - 0.5 * FIGURE_TITLE / height)
    return figure


def save_picture(figure: Figure, path: Path) -> np.ndarray:
    """Draws `figure` once, at its dpi (`new_figure`'s `PICTURE_DPI`), writes the drawing to `path`
    as PNG and returns its RGB pixels `[H, W, 3]` uint8 (for TensorBoard). One draw for both: text
    layout is most of a picture's cost, and `savefig` then a second draw for the pixels paid it twice."""
    from matplotlib import image as mpl_image

    figure.canvas.draw()
    rgba = np.asarray(figure.canvas.buffer_rgba())
    mpl_image.imsave(path, rgba, format="png", dpi=figure.dpi)
    return rgba[..., :3].copy()


def axis_tokens(
    role: AttentionRole, source: Sequence[str], output: Sequence[str]
) -> tuple[Sequence[str], Sequence[str]]:
    """`(key tokens along x, query tokens along y)` of a module with `role`."""
    from models.attention import AttentionRole

    return {
        AttentionRole.CROSS: (source, output),
        AttentionRole.SOURCE_SELF: (source, source),
        AttentionRole.TARGET_SELF: (output, output),
    }[role]


def example_weights(
    weights: Mapping[str, Any],
    roles: Mapping[str, AttentionRole],
    row: int,
    source_length: int | None,
    output_length: int,
) -> dict[str, np.ndarray]:
    """One example's `[N, Tq, Tk]` weights of every module, cut to its real source and output tokens
    (`source_length` None: every source position, e.g. an image's grid cells)."""
    lengths = {"source": source_length, "output": output_length}
    cut = {}
    for module, value in weights.items():
        keys, queries = axis_tokens(roles[module], "source", "output")
        cut[module] = np.asarray(value[row])[:, : lengths[queries], : lengths[keys]]
    return cut


def npz_key(module: str) -> str:
    """A module path as a file name part and an `.npz` key: each run of non-alphanumerics becomes "_"."""
    return re.sub("[^A-Za-z0-9]+", "_", module)


def file_stem(name: str, module: str) -> str:
    return f"{name}_{npz_key(module)}"


def draw_example(
    directory: Path,
    name: str,
    weights: Mapping[str, np.ndarray],
    roles: Mapping[str, AttentionRole],
    source_tokens: Sequence[str],
    output_tokens: Sequence[str],
    *,
    self_attention: bool = False,
    extras: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Writes `<name>_<module>.png` per attention module (cross-attention only, unless `self_attention`)
    and `<name>.npz` with every module's weights, the module paths (`modules`) and their roles
    (`roles`, the `AttentionRole` values) in the same order, and `extras` (e.g. the task's gold
    `alignment` spans `[K, 4]`, for report/pages.py); returns the pictures' pixels by file stem.

    Args:
      weights: module path -> `[N, Tq, Tk]` of this example, cut to its real tokens (`example_weights`).
      roles: module path -> its role (`models.attention.attention_roles`).
    """
    from models.attention import AttentionRole

    directory.mkdir(parents=True, exist_ok=True)
    pictures = {}
    for module, value in weights.items():
        if roles[module] is not AttentionRole.CROSS and not self_attention:
            continue
        key_tokens, query_tokens = axis_tokens(roles[module], source_tokens, output_tokens)
        figure = heatmaps(np.asarray(value), key_tokens, query_tokens, f"{name}: {module}")
        stem = file_stem(name, module)
        pictures[stem] = save_picture(figure, directory / f"{stem}.png")
    save_weights(directory / f"{name}.npz", weights, roles, source_tokens, output_tokens, extras)
    return pictures


def save_weights(
    path: Path,
    weights: Mapping[str, np.ndarray],
    roles: Mapping[str, AttentionRole],
    source_tokens: Sequence[str],
    output_tokens: Sequence[str],
    extras: Mapping[str, np.ndarray] | None = None,
) -> None:
    """`path` (.npz): the tokens, each module's `[N, Tq, Tk]` weights under its path with every
    non-alphanumeric run as "_", `modules` (the paths) and `roles` (their `AttentionRole` values) in one
    order, and `extras` (e.g. the gold `alignment` spans `[K, 4]`): what report/pages.py's explorer reads."""
    arrays = {npz_key(k): np.asarray(v) for k, v in weights.items()}
    described = {
        "modules": np.array(list(weights), dtype=str),
        "roles": np.array([roles[k].value for k in weights], dtype=str),
    }
    np.savez(
        path,
        source_tokens=np.array(source_tokens),
        output_tokens=np.array(output_tokens),
        **described,
        **dict(extras or {}),
        **arrays,
    )


def draw_image_attention(
    directory: Path,
    name: str,
    image: np.ndarray,
    weights: np.ndarray,
    grid: tuple[int, int],
    words: Sequence[str],
    extras: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """As Xu et al.'s figures: the image once per generated word, with that word's attention over the
    annotation grid laid over it. Writes `<name>_caption.png` and `<name>.npz` (with `extras`, e.g. the
    words' `boxes` `[K, 4]` and the cells' `centres` `[L, 2]` for report/pages.py); returns the pixels.

    Args:
      image: `[H, W, C]` uint8. weights: `[T, L]`, a row per word (L = h * w, row-major).
      grid: `(h, w)` of the annotation grid. words: the T words.
    """
    directory.mkdir(parents=True, exist_ok=True)
    height, width = image.shape[:2]
    picture = image[..., 0] if image.shape[-1] == 1 else image
    # wide strips: fewer columns
    columns = max(1, min(len(words), round(8 / max(width / height, 1.0))))
    rows = -(-len(words) // columns) or 1
    figure = new_figure(figsize=(columns * max(2.0, 2.0 * width / height), rows * 2.2))
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axis, word, row in zip(axes.flat, words, weights):
        axis.imshow(picture, cmap="gray", extent=(0, width, height, 0))
        axis.imshow(
            np.asarray(row).reshape(grid),
            cmap="magma",
            alpha=0.6,
            extent=(0, width, height, 0),
            vmin=0.0,
            vmax=max(float(np.max(row)), 1e-6),
            interpolation="bilinear",
        )
        axis.set_title(word, fontsize=9)
    figure.suptitle(name, fontsize=10)
    figure.tight_layout()
    stem = f"{name}_caption"
    pixels = save_picture(figure, directory / f"{stem}.png")
    np.savez(
        directory / f"{name}.npz",
        image=image,
        weights=np.asarray(weights),
        words=np.array(list(words)),
        grid=np.array(grid),
        **dict(extras or {}),
    )
    return {stem: pixels}
