"""Attention pictures: heat maps with the source tokens along x and the output tokens along y.

For the Transformer, each decoder layer's encoder-decoder attention, every head
and their mean in one figure; self-attention on request. Beside every picture,
the weights themselves as `.npz` (with the source and output tokens), so they
can be analysed without re-running the model.

The trainer writes pictures of a few fixed dev examples at every evaluation to
`WORKDIR/attention/step_<N>/` (and to TensorBoard). On demand:

    python visualize.py --workdir runs/default-... --text "3rd of March, 2021" [--self_attention]

restores the run's latest checkpoint, decodes the text with the run's search,
and draws its attention into `WORKDIR/attention/text/`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models.attention import AttentionWeights  # noqa: E402


def attention_weights(model: nnx.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """Every attention module's weights of a teacher-forced pass, by module path.

    Returns:
      e.g. `{'decoder_layers/1/cross_attention': [B, N, T, S], ...}`.
    """
    _, recorded = nnx.capture(model, AttentionWeights)(batch)
    weights = {}
    for path, variable in nnx.to_flat_state(recorded):
        module_path = "/".join(str(part) for part in path[:-1])
        (value,) = variable.get_value()  # one call of each module per forward pass
        weights[module_path] = value
    return weights


def is_cross_attention(name: str) -> bool:
    return "cross" in name


def heatmaps(
    weights: np.ndarray, source_tokens: Sequence[str], output_tokens: Sequence[str], title: str
) -> plt.Figure:
    """One panel per head of `weights [N, T, S]` and a last panel of their mean."""
    panels = list(weights) + [weights.mean(axis=0)] if weights.shape[0] > 1 else [weights[0]]
    names = [f"head {n}" for n in range(weights.shape[0])] + ["mean over heads"] if len(panels) > 1 else ["attention"]
    columns = min(len(panels), 3)
    rows = -(-len(panels) // columns)
    cell = 0.28
    width = max(4.0, cell * len(source_tokens) + 1.5)
    height = max(3.0, cell * len(output_tokens) + 1.2)
    figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.axis("off")
    for axis, panel, name in zip(axes.flat, panels, names):
        axis.imshow(panel, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        axis.set_xticks(range(len(source_tokens)), source_tokens, rotation=90, fontsize=7)
        axis.set_yticks(range(len(output_tokens)), output_tokens, fontsize=7)
        axis.set_title(name, fontsize=9)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    return figure


def figure_pixels(figure: plt.Figure) -> np.ndarray:
    """RGB `[H, W, 3]` uint8 of a drawn figure (for TensorBoard)."""
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


def draw_example(
    directory: Path,
    name: str,
    weights: Mapping[str, np.ndarray],
    source_tokens: Sequence[str],
    output_tokens: Sequence[str],
    *,
    self_attention: bool = False,
) -> dict[str, np.ndarray]:
    """Writes `<name>_<module>.png` per attention module and `<name>.npz`; returns the pictures' pixels.

    Args:
      weights: module path -> `[N, T, S]` (or `[N, T, T]` self-attention) of this example,
        already cut to its real tokens.
    """
    directory.mkdir(parents=True, exist_ok=True)
    pictures = {}
    for module, value in weights.items():
        cross = is_cross_attention(module)
        if not (cross or self_attention):
            continue
        x_tokens = source_tokens if cross or module.startswith("encoder") else output_tokens
        y_tokens = source_tokens if module.startswith("encoder") else output_tokens
        figure = heatmaps(np.asarray(value), x_tokens, y_tokens, f"{name}: {module}")
        stem = f"{name}_{re.sub('[^A-Za-z0-9]+', '_', module)}"
        figure.savefig(directory / f"{stem}.png", dpi=90)
        pictures[stem] = figure_pixels(figure)
        plt.close(figure)
    arrays = {re.sub("[^A-Za-z0-9]+", "_", k): np.asarray(v) for k, v in weights.items()}
    np.savez(directory / f"{name}.npz", source_tokens=np.array(source_tokens), output_tokens=np.array(output_tokens), **arrays)
    return pictures


def example_weights(weights: Mapping[str, Any], row: int, source_length: int, output_length: int) -> dict[str, np.ndarray]:
    """One example's `[N, T, S]` weights, cut to its real source and output tokens."""
    cut = {}
    for module, value in weights.items():
        value = np.asarray(value[row])
        if module.startswith("encoder"):
            cut[module] = value[:, :source_length, :source_length]
        elif is_cross_attention(module):
            cut[module] = value[:, :output_length, :source_length]
        else:
            cut[module] = value[:, :output_length, :output_length]
    return cut


def main(argv: Sequence[str]) -> int:
    import argparse
    import json

    import jax
    import ml_collections

    import trainer
    from tokenizers import EOS_ID

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--text", required=True, help="a source sentence")
    parser.add_argument("--self_attention", action="store_true", help="draw self-attention too")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    if not (workdir / "config.json").exists():
        print(f"error: {workdir} holds no config.json: not a run folder", file=sys.stderr)
        return 2
    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    run = trainer.prepare_run(config, workdir, devices=jax.devices()[:1])
    step, state = trainer.restore_for_eval(run)
    tokens = run.tokens
    ids = np.append(tokens.source.encode(args.text), EOS_ID)[None].astype(np.int32)  # [1, S]
    model = trainer.merge_model(run.graphdef, state["params"], run.rngs)
    decoded = np.asarray(run.decode(state["params"], ids))
    output_ids = decoded[:, : int(np.argmax(decoded[0] == EOS_ID)) + 1]
    weights = attention_weights(model, {"inputs": ids, "targets": output_ids})
    source_tokens = tokens.source.pieces(ids[0])
    output_tokens = tokens.target.pieces(output_ids[0])
    directory = workdir / "attention" / "text"
    draw_example(
        directory, f"step_{step}", example_weights(weights, 0, len(source_tokens), len(output_tokens)),
        source_tokens, output_tokens, self_attention=args.self_attention,
    )  # fmt: skip
    print(f"{args.text!r} -> {tokens.target.decode(output_ids[0])!r}")
    print(f"pictures and weights: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
