"""The input kinds: what a source is (text, an image, a feature grid) and everything that differs by it.

One class per kind owns how a record becomes model inputs, how a batch of them
is padded, how a source is shown in predictions and drawn in pictures, and how
one is read from the Python API. The trainer, evaluation, inference and the
input pipeline ask the run's kind (`settings.source`, from what its model reads)
and name none. Adding a kind is one class here and its entry in `KINDS`, and
the name its models read it by (`models.interface.READS`, mapped to the kind by
`models.SOURCE_KINDS`).

    kind = settings.source                 # a TextSource, ImageSource or FeatureSource
    encode = kind.encoder(task, split, tokenizers, limits)   # index -> {'inputs', 'targets'}
    kind.user_rows(sources, settings, tokenizers)            # the Python API's sources as model inputs
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from models.attention import AttentionRole
from report import pictures
from tasks import Task, with_channels
from tasks.token_cache import token_ids
from tasks.vocabularies import EOS_ID, PAD_ID, Tokenizers
from utils.errors import ConfigError, UserError

Batch = dict[str, np.ndarray]


# ----------------------------------------------------------------------------- text's token ids


def target_ids(text: str, tokenizers: Tokenizers, limit: int) -> np.ndarray:
    """A target text's int32 ids ending in eos, at most `limit` of them."""
    return np.append(tokenizers.target.encode(text)[: limit - 1], EOS_ID).astype(np.int32)


def padded_ids(rows: Sequence[np.ndarray], size: int, length_limit: int) -> np.ndarray:
    """`[max(size, len(rows)), L]` ids: L the next power of two of the longest row (few shapes, few
    compilations), but no longer than `length_limit` (learned positions end there) unless a row is."""
    longest = max(len(r) for r in rows)
    length = min(1 << longest.bit_length(), max(length_limit, longest))
    array = np.zeros((max(size, len(rows)), length), np.int32)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array


# ----------------------------------------------------------------------------- the kinds


class SourceKind:
    """What differs by the kind of source. Subclasses set the class fields and override the methods."""

    name: ClassVar[str]
    # what a task's records hold for this kind: "text" or "image" (an array)
    task_inputs: ClassVar[str]
    # a source has a length in tokens: decoding limits, batches by length, scores by length
    has_length: ClassVar[bool]
    # several sources fit in one row
    packs: ClassVar[bool]
    # attention is over grid cells at known pixel positions (localisation scores)
    spatial: ClassVar[bool] = False

    # -- data

    def tokenizer_pairs(self, pairs: Iterable[tuple[str, str]]) -> Iterable[tuple[str, str]]:
        """The (source, target) texts the vocabularies learn from."""
        return pairs

    def check_task(self, task: Task, model_fields: Mapping[str, Any]) -> None:
        """Stops with a ConfigError where the task's first source does not fit the model."""

    def encoder(
        self, task: Task, split: str, tokenizers: Tokenizers, max_source_length: int, max_target_length: int
    ) -> Callable[[int], Batch]:
        """index -> `{'inputs', 'targets'}` of example `index` of `split`: targets are int32 ids ending in eos,
        trimmed to the limits."""
        records = task.splits[split]

        def encode(index: int) -> Batch:
            # read (and its image decoded) once
            record = records[index]
            return {
                "inputs": task.image(record),
                "targets": target_ids(task.pair(record)[1], tokenizers, max_target_length),
            }

        return encode

    def lengths(self, task: Task, split: str, tokenizers: Tokenizers) -> np.ndarray:
        """`[N, 2]` source and target lengths in tokens, eos included (a source without length counts 1)."""
        records = task.splits[split]
        return np.array(
            [(1, len(tokenizers.target.encode(task.pair(records[i])[1])) + 1) for i in range(len(records))], np.int64
        ).reshape(-1, 2)

    def padded_keys(self, max_source_length: int, max_target_length: int) -> dict[str, int]:
        """The keys of a batch padded in length, and their longest lengths (an array source has its own shape)."""
        return {"targets": max_target_length}

    def blank(self, task: Task, split: str) -> np.ndarray:
        """A padding row's source."""
        return np.zeros_like(task.image(task.splits[split][0]))

    # -- showing

    def shown(self, task: Task, split: str, index: int) -> str:
        """The source of example `index` as the predictions file shows it."""
        return f"{split}[{index}]"

    def source_length(self, inputs: np.ndarray) -> int | None:
        """The real positions of one row's source (None: every position, e.g. an image's grid cells)."""
        return None

    def draw(
        self,
        directory: Path,
        name: str,
        inputs: np.ndarray,
        weights: Mapping[str, np.ndarray],
        roles: Mapping[str, AttentionRole],
        output_words: Sequence[str],
        tokenizers: Tokenizers,
        model: Any,
        *,
        self_attention: bool = False,
        extras: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Draws one example's attention (`weights` cut to its positions) into `directory`, with `extras`
        (the task's gold `alignment` or `boxes` of the example) kept beside the weights; returns the pictures."""
        return {}

    # -- the Python API

    def user_rows(
        self, sources: Sequence, model_fields: Mapping[str, Any], tokenizers: Tokenizers, max_source_length: int
    ) -> list[np.ndarray]:
        """The model inputs of a user's sources, checked."""
        raise NotImplementedError

    def from_command_line(self, given: str, task_params: Mapping[str, Any], model_fields: Mapping[str, Any]) -> Any:
        """The source a command line names (`inference.py --text/--image/--features`), as the Python API takes it."""
        return given

    def user_batch(self, rows: Sequence[np.ndarray], size: int, length_limit: int) -> np.ndarray:
        """`[max(size, len(rows)), ...]`: the rows stacked, zero rows after them (one shape, one compilation)."""
        if len({row.shape for row in rows}) > 1:
            raise UserError(
                f"the {self.name} sources of one call must have one shape, got {sorted({row.shape for row in rows})}"
            )
        batch = np.zeros((max(size, len(rows)), *rows[0].shape), rows[0].dtype)
        batch[: len(rows)] = rows
        return batch


class TextSource(SourceKind):
    """Token ids `[S]` ending in eos, from a source text."""

    name, task_inputs, has_length, packs = "text", "text", True, True

    def encoder(self, task, split, tokenizers, max_source_length, max_target_length):
        return functools.partial(
            token_ids(task, split, tokenizers).example,
            max_source_length=max_source_length,
            max_target_length=max_target_length,
        )

    def lengths(self, task, split, tokenizers):
        return token_ids(task, split, tokenizers).lengths()

    def padded_keys(self, max_source_length, max_target_length):
        return {"inputs": max_source_length, "targets": max_target_length}

    def blank(self, task, split):
        return np.zeros(0, np.int32)

    def shown(self, task, split, index):
        return task.pair(task.splits[split][index])[0]

    def source_length(self, inputs):
        return int((inputs != PAD_ID).sum())

    def draw(
        self,
        directory,
        name,
        inputs,
        weights,
        roles,
        output_words,
        tokenizers,
        model,
        *,
        self_attention=False,
        extras=None,
    ):
        source = inputs[inputs != PAD_ID]
        return pictures.draw_example(
            directory,
            name,
            weights,
            roles,
            tokenizers.source.pieces(source),
            output_words,
            self_attention=self_attention,
            extras=extras,
        )

    def user_rows(self, sources, model_fields, tokenizers, max_source_length):
        if not all(isinstance(source, str) for source in sources):
            raise UserError("this run translates text; give strings")
        # room for eos, as in evaluation
        limit = max_source_length - 1
        return [np.append(tokenizers.source.encode(text)[:limit], EOS_ID).astype(np.int32) for text in sources]

    def user_batch(self, rows, size, length_limit):
        return padded_ids(rows, size, length_limit)


class ImageSource(SourceKind):
    """An image `[H, W, C]` uint8 (a grey `[H, W]` one gets its channel), read by the captioner's CNN."""

    name, task_inputs, has_length, packs, spatial = "image", "image", False, False, True

    def tokenizer_pairs(self, pairs):
        # no source text: the (unused) source vocabulary learns the captions
        return ((target, target) for _, target in pairs)

    def check_task(self, task, model_fields):
        shape = task.image(task.splits["train"][0]).shape
        if len(shape) != 3 or shape[-1] != model_fields["channels"]:
            raise ConfigError(
                f"task {task.name}'s images have shape {shape} (height, width, channels), but model.channels = "
                f"{model_fields['channels']}; set model.channels={shape[-1]}"
            )

    def draw(
        self,
        directory,
        name,
        inputs,
        weights,
        roles,
        output_words,
        tokenizers,
        model,
        *,
        self_attention=False,
        extras=None,
    ):
        (cross,) = [w.mean(axis=0) for module, w in weights.items() if roles[module] is AttentionRole.CROSS]
        grid = model.grid_shape(*inputs.shape[:2])
        # where each cell is, for localisation
        centres = {"centres": np.asarray(model.cell_centres(*inputs.shape[:2]))}
        return pictures.draw_image_attention(
            directory, name, inputs, cross, grid, output_words, {**centres, **dict(extras or {})}
        )

    def from_command_line(self, given, task_params, model_fields):
        """An image file as the run's images are: its channels, resized to the task's size."""
        from PIL import Image

        from tasks.image_captions import resized

        sizes = ("canvas_height", "canvas_width") if "canvas_height" in task_params else ("height", "width")
        try:
            with Image.open(given) as image:
                return resized(image, *(task_params[size] for size in sizes), model_fields["channels"])
        except OSError as error:
            raise UserError(f"cannot read the image {given}: {error}") from error

    def user_rows(self, sources, model_fields, tokenizers, max_source_length):
        if any(isinstance(source, str) for source in sources):
            raise UserError("this run captions images; give [H, W] or [H, W, C] uint8 arrays, not text")
        rows = [with_channels(np.asarray(image)) for image in sources]
        channels = model_fields["channels"]
        for row in rows:
            if row.ndim != 3 or row.shape[-1] != channels or row.dtype != np.uint8:
                raise UserError(
                    f"images must be uint8 [H, W, {channels}] (model.channels), got {row.dtype} {row.shape}"
                )
        return rows


class FeatureSource(SourceKind):
    """A precomputed annotation grid `[L, D]` float (a pretrained backbone's output), read as it is."""

    name, task_inputs, has_length, packs = "features", "image", False, False

    def tokenizer_pairs(self, pairs):
        return ((target, target) for _, target in pairs)

    def draw(
        self,
        directory,
        name,
        inputs,
        weights,
        roles,
        output_words,
        tokenizers,
        model,
        *,
        self_attention=False,
        extras=None,
    ):
        # a grid's positions have no text or pixels: named by index
        cells = [f"cell {i}" for i in range(inputs.shape[0])]
        return pictures.draw_example(
            directory, name, weights, roles, cells, output_words, self_attention=self_attention, extras=extras
        )

    def from_command_line(self, given, task_params, model_fields):
        """A `.npy` file holding one feature grid `[L, D]`."""
        try:
            return np.load(given)
        except (OSError, ValueError) as error:
            raise UserError(f"cannot read the feature grid {given} (a .npy file of [L, D] floats): {error}") from error

    def user_rows(self, sources, model_fields, tokenizers, max_source_length):
        if any(isinstance(source, str) for source in sources):
            raise UserError("this run reads feature grids; give [L, D] float arrays, not text")
        rows = [np.asarray(grid, np.float32) for grid in sources]
        dim = model_fields["feature_dim"]
        for row in rows:
            if row.ndim != 2 or row.shape[-1] != dim:
                raise UserError(f"feature grids must be [L, {dim}] (model.feature_dim), got {row.shape}")
        return rows


KINDS: dict[str, SourceKind] = {kind.name: kind for kind in (TextSource(), ImageSource(), FeatureSource())}
