"""Inference from a run folder, in Python or from the command line.

    translator = inference.load("runs/X")                 # latest checkpoint; or step=N, best=True, average_last=K
    translator.translate(["3rd of March, 2021"], beam_size=4)      # -> ["2021-03-03"]
    translator.score(["3rd of March, 2021"], ["2021-03-03"])       # -> summed log-probabilities, eos included
    translator.attention("3rd of March, 2021")                     # -> {module: weights [N, T, S]}
    captioner.translate(images)                # a captioning run: images [H, W] or [H, W, C] uint8 -> captions

    python inference.py --workdir=runs/X --text "3rd of March, 2021" [--self_attention]

`load` reads only the run folder: `config.json`, the vocabulary in
`tokenizer/` and the parameters of a checkpoint (no optimizer state, no
training data), so a run folder copied to another machine decodes. The command
prints the output and draws its attention into `WORKDIR/attention/text/`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import decoding
import reporting
import visualize
from errors import ConfigError, DataError, UserError
from models.attention import AttentionRole, attention_roles, capture_attention
from run_setup import Run, output_length, prepare_run, read_run_config
from tasks import inputs_of, with_channels
from vocabularies import EOS_ID, PAD_ID

BATCH_ROWS = 32  # sources decoded together; batches are padded to this many rows (one compilation)


class Translator:
    """A trained model with its vocabulary and search; see the module docstring."""

    def __init__(self, run: Run, step: int, params):
        self.run, self.step, self.params = run, step, params
        self.roles = attention_roles(run.model(params))
        self._searches: dict[tuple, object] = {}  # compiled searches by decode settings
        self.reads_images = inputs_of(run.config.task.name) == "image"  # a captioning run: sources are images

    @property
    def config(self) -> ml_collections.ConfigDict:
        return self.run.config

    def _source_ids(self, sources: Sequence[str]) -> list[np.ndarray]:
        limit = self.config.data.max_source_length - 1  # room for eos, as in evaluation
        return [np.append(self.run.tokens.source.encode(text)[:limit], EOS_ID).astype(np.int32) for text in sources]

    def _target_ids(self, targets: Sequence[str]) -> list[np.ndarray]:
        ids = [np.append(self.run.tokens.target.encode(text), EOS_ID).astype(np.int32) for text in targets]
        limit = getattr(self.run.model(self.params).config, "length_limit", None)  # learned positions, LSTMN tapes
        if limit is not None and max(map(len, ids)) > limit:
            raise UserError(f"a target of {max(map(len, ids))} tokens is longer than model.max_length = {limit}")
        return ids

    def _padded(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        """`[BATCH_ROWS, L]`: L the next power of two of the longest row (few shapes, few compilations),
        but no longer than the data limits (learned positions end there)."""
        limit = max(self.config.data.max_source_length, self.config.data.max_target_length)
        length = min(1 << max(len(r) for r in rows).bit_length(), max(limit, max(len(r) for r in rows)))
        array = np.zeros((max(BATCH_ROWS, len(rows)), length), np.int32)
        for i, row in enumerate(rows):
            array[i, : len(row)] = row
        return array

    def _decode_settings(self, overrides: dict) -> tuple:
        """`config.decode` with `overrides` (e.g. `beam_size=4`), checked, as a hashable tuple of items."""
        settings = self.config.decode.to_dict()
        unknown = sorted(set(overrides) - set(settings))
        if unknown:
            raise ConfigError(f"unknown decode option(s) {', '.join(unknown)}; valid: {', '.join(sorted(settings))}")
        settings.update({k: v for k, v in overrides.items() if v is not None})
        decoding.check_options(ml_collections.ConfigDict(settings))
        return tuple(sorted(settings.items()))

    def _search(self, settings: tuple):
        """The search compiled for these decode settings (kept on this translator, one per settings)."""
        if settings not in self._searches:
            run, options = self.run, decoding.options(ml_collections.ConfigDict(dict(settings)))
            length = output_length(self.config, options["max_length_offset"])

            @jax.jit
            def search(params, inputs, key):
                return decoding.decode(run.model(params), inputs, length=length, key=key, **options)

            self._searches[settings] = search
        return self._searches[settings]

    def _source_rows(self, sources: Sequence) -> list[np.ndarray]:
        """Token ids of each source text, or each source image as `[H, W, C]` uint8 (or a feature grid)."""
        if not self.reads_images:
            if not all(isinstance(source, str) for source in sources):
                raise UserError("this run translates text; give strings")
            return self._source_ids(sources)
        if any(isinstance(source, str) for source in sources):
            raise UserError("this run captions images; give [H, W] or [H, W, C] uint8 arrays, not text")
        rows = [with_channels(np.asarray(image)) for image in sources]
        model = self.config.model
        for row in rows:
            if model.inputs == "pixels" and (row.ndim != 3 or row.shape[-1] != model.channels or row.dtype != np.uint8):
                raise UserError(f"images must be uint8 [H, W, {model.channels}] (model.channels), got {row.dtype} {row.shape}")
        return rows

    def _source_batch(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        if not self.reads_images:
            return self._padded(rows)
        if len({row.shape for row in rows}) > 1:
            raise UserError(f"images of one call must have one shape, got {sorted({row.shape for row in rows})}")
        batch = np.zeros((max(BATCH_ROWS, len(rows)), *rows[0].shape), rows[0].dtype)
        batch[: len(rows)] = rows
        return batch

    def translate(self, sources: Sequence, **decode_options) -> list[str]:
        """The model's output for each source (text, or for a captioning run an image), with the run's
        `config.decode` unless options (`beam_size=4`, `length_penalty=0.6`, `method="sample"`,
        `temperature=0.7`, ...) say otherwise."""
        return [hypotheses[0][0] for hypotheses in self.n_best(sources, **decode_options)]

    def n_best(self, sources: Sequence, **decode_options) -> list[list[tuple[str, float]]]:
        """The `num_hypotheses` best outputs of each source with their scores, best first."""
        return [
            [(self.run.tokens.target.decode(ids), score) for ids, score in hypotheses]
            for hypotheses in self.translate_ids(sources, **decode_options)
        ]

    def translate_ids(self, sources: Sequence, **decode_options) -> list[list[tuple[np.ndarray, float]]]:
        """As `n_best`, with output ids ending in eos instead of text."""
        search = self._search(self._decode_settings(decode_options))
        key = jax.random.key(self.config.seed + 3)  # sampling: one key per batch, so a sample depends on its batch
        rows = self._source_rows(sources)
        # Sources of similar length decode together: a batch's search runs until its longest
        # output ends, and its sources are padded to the next power of two of its longest.
        order = np.argsort([len(row) for row in rows], kind="stable") if not self.reads_images else np.arange(len(rows))
        outputs = [None] * len(rows)
        for start in range(0, len(rows), BATCH_ROWS):
            chunk = order[start : start + BATCH_ROWS]
            batch = jnp.asarray(self._source_batch([rows[i] for i in chunk]))
            tokens, scores = search(self.params, batch, jax.random.fold_in(key, start))
            for i, row_tokens, row_scores in zip(chunk, np.asarray(tokens), np.asarray(scores)):
                outputs[i] = [
                    (ids[: int(np.argmax(ids == EOS_ID)) + 1], float(score))
                    for ids, score in zip(row_tokens, row_scores) if score > decoding.NEVER / 2
                ]  # fmt: skip
        return outputs

    @functools.cached_property
    def _log_probs(self):
        run = self.run

        @jax.jit
        def log_probs(params, batch):
            logits = run.model(params)(batch, deterministic=True)
            token_log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1)[..., 0]
            return jnp.sum(jnp.where(batch["targets"] != PAD_ID, token_log_probs, 0.0), axis=-1)  # [B]

        return log_probs

    def score(self, sources: Sequence, targets: Sequence[str]) -> np.ndarray:
        """`log P(target | source)` of each pair, summed over the target's tokens, eos included: `[len(sources)]`."""
        if len(sources) != len(targets):
            raise UserError(f"score needs as many targets as sources, got {len(targets)} and {len(sources)}")
        source_ids, target_ids = self._source_rows(sources), self._target_ids(targets)
        scores = []
        for start in range(0, len(source_ids), BATCH_ROWS):
            inputs = self._source_batch(source_ids[start : start + BATCH_ROWS])
            outputs = self._padded(target_ids[start : start + BATCH_ROWS])
            batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(outputs)}
            scores.append(np.asarray(self._log_probs(self.params, batch))[: len(source_ids[start : start + BATCH_ROWS])])
        return np.concatenate(scores)

    def attention(self, source, target: str | None = None) -> dict[str, np.ndarray]:
        """Every attention module's weights `[N, Tq, Tk]` for `source` (a text, or an image) and
        `target` (default: the model's own output), cut to their real tokens (an image: every grid
        cell), by module path (roles in `self.roles`)."""
        return self._attention_of(*self._attention_inputs(source, target))

    def _attention_inputs(self, source, target: str | None) -> tuple[np.ndarray, np.ndarray]:
        inputs = self._source_rows([source])[0]
        output = self.translate_ids([source])[0][0][0] if target is None else self._target_ids([target])[0]
        return inputs, output

    def _attention_of(self, inputs: np.ndarray, output: np.ndarray) -> dict[str, np.ndarray]:
        weights = capture_attention(self.run.model(self.params), {"inputs": inputs[None], "targets": output[None]})
        return visualize.example_weights(weights, self.roles, 0, None if self.reads_images else len(inputs), len(output))

    def draw_attention(self, source, directory: Path, *, self_attention: bool = False) -> str:
        """Decodes `source` and draws its attention into `directory`; returns the output text."""
        inputs, output = self._attention_inputs(source, None)
        weights = self._attention_of(inputs, output)  # the decoded ids themselves, not their text re-encoded
        if self.reads_images:
            (cross,) = [w.mean(axis=0) for module, w in weights.items() if self.roles[module] is AttentionRole.CROSS]
            grid = self.run.model(self.params).grid_shape(*inputs.shape[:2])
            visualize.draw_image_attention(directory, f"step_{self.step}", inputs, cross, grid, self.run.tokens.target.pieces(output))
            return self.run.tokens.target.decode(output)
        visualize.draw_example(
            directory, f"step_{self.step}", weights, self.roles,
            self.run.tokens.source.pieces(inputs), self.run.tokens.target.pieces(output), self_attention=self_attention,
        )  # fmt: skip
        return self.run.tokens.target.decode(output)


def load(
    workdir: str | Path,
    *,
    step: int | None = None,
    best: bool = False,
    average_last: int = 0,
    config: ml_collections.ConfigDict | None = None,
) -> Translator:
    """A `Translator` of the run in `workdir`: checkpoint `step`, the best, or the latest; with
    `average_last=K > 1`, the mean parameters of the last K checkpoints up to that one.

    `config` replaces `workdir/config.json` (eval and predict pass theirs, with its decode settings).
    """
    if config is None:
        config = read_run_config(workdir)
        if config is None:
            raise DataError(f"{workdir} holds no config.json: not a run folder")
    config = ml_collections.ConfigDict(config.to_dict())
    config.update(coordinator_address="", num_processes=-1, process_id=-1)  # one process, whatever trained it
    run = prepare_run(config, workdir, devices=jax.local_devices()[:1], with_data=False, training=False)
    restored_step, params = run.restore_params(step, best=best)
    if average_last > 1:
        _, params = run.averaged_params(average_last, restored_step)
    run.checkpoints.close()
    return Translator(run, restored_step, params)


def translate_file(config: ml_collections.ConfigDict, workdir: str | Path, input_file: str) -> Path:
    """`train.py --mode=predict --input_file=FILE` (`-`: standard input): one source per line into
    `predictions/step_<N>_<name>.tsv` (source, empty reference, hypothesis). Blank lines are skipped."""
    text = sys.stdin.read() if input_file == "-" else _read_text(input_file)
    sources = [line.strip() for line in text.splitlines() if line.strip()]
    if not sources:
        raise DataError(f"--input_file {input_file} holds no source line")
    if inputs_of(config.task.name) == "image":
        raise UserError("--input_file reads text lines; a captioning run captions images: use --mode=predict on its "
                        "task's split, or inference.load(workdir).translate(images) from Python")  # fmt: skip
    restore_step = config.restore_step if config.restore_step >= 0 else None
    translator = load(workdir, step=restore_step, best=config.restore_best, average_last=config.average_last, config=config)
    hypotheses = translator.translate(sources)
    name = "stdin" if input_file == "-" else Path(input_file).stem
    path = Path(workdir) / "predictions" / f"step_{translator.step}_{name}.tsv"
    reporting.write_predictions(path, [(source, "", hypothesis) for source, hypothesis in zip(sources, hypotheses)])
    return path


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"--input_file {path} cannot be read: {error}") from error


def read_image(path: str, translator: Translator) -> np.ndarray:
    """An image file as the run's images are: its channels, resized to the task's size."""
    from PIL import Image

    from tasks.image_captions import resized

    task = translator.config.task
    height, width = (task.get("canvas_height"), task.get("canvas_width")) if "canvas_height" in task else (task.height, task.width)
    try:
        with Image.open(path) as image:
            return resized(image, height, width, translator.config.model.channels)
    except OSError as error:
        raise UserError(f"cannot read the image {path}: {error}") from error


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a run folder")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="a source sentence")
    source.add_argument("--image", help="an image file, for a captioning run (converted to its channels and size)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint (default: the latest)")
    parser.add_argument("--self_attention", action="store_true", help="draw self-attention too")
    args = parser.parse_args(argv)
    try:
        translator = load(args.workdir, step=args.step)
        source = args.text if args.text is not None else read_image(args.image, translator)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    directory = Path(args.workdir) / "attention" / ("text" if args.text is not None else "image")
    output = translator.draw_attention(source, directory, self_attention=args.self_attention)
    print(f"{args.text or args.image!r} -> {output!r}")
    print(f"pictures and weights: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
