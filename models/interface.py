"""The model interface: what every family implements, and what a family may do besides, declared.

One trainer and one decoder serve every family through `EncoderDecoder`. What only some families
do is not found out by probing a model (`hasattr(model, "objective")`): each family's
hyperparameter dataclass, a `ModelConfig`, states it, and the model carries that dataclass as
`model.config`. The defaults are given once, below; a family states what differs.

    declared on the config                 what it promises
    reads = "tokens"|"pixels"|"features"   the kind of `inputs`; "pixels": the model is an `ImageGrid`
    roles                                  the `AttentionRole`s of its attention modules
    has_objective                          the model is an `OwnObjective` (trains by its own loss)
    has_decode                             the model is a `TeacherForcedDecoder`
    needs_shared_vocabulary                source and target must share one vocabulary
    fields_before                          what a run saved before a field existed meant by its absence
    renamed_values                         a field's old value names, read as their new ones
    length_limit                           the longest sequence it takes (None: no limit)
    tape_bytes(batch, length)              training memory beyond parameters and logits (0: none)

tests/test_model_interface.py checks every registered family against these.
Axis names as in `models/attention.py`; V is the target vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import numpy as np

from models.attention import AttentionRole

Array = jax.Array
READS = ("tokens", "pixels", "features")


class ModelConfig:
    """Base of every family's hyperparameter dataclass: the optional capabilities, declared.

    The defaults are those of a plain text-to-text model that attends nowhere. A family overrides
    what differs: a class attribute, or a property where it depends on the hyperparameters.
    Consumers read these (`model.config.has_objective`, `settings.model.hyperparameters.length_limit`).
    """

    # What `inputs` are: "tokens" ids `[B, S]`; "pixels" images `[B, H, W, C]` (uint8, or float
    # in [0, 1]), and the model is an `ImageGrid`; "features" annotation grids `[B, L, D]` float.
    reads: ClassVar[str] = "tokens"
    # The roles of its attention modules (`attention.attention_roles(model)` finds them by path);
    # empty: the model does not attend.
    roles: ClassVar[frozenset[AttentionRole]] = frozenset()
    # The model computes its own training loss and carries state between steps: an `OwnObjective`.
    has_objective: ClassVar[bool] = False
    # The model has a teacher-forced decoder apart from its encoder: a `TeacherForcedDecoder`
    # (`decoding.WithoutCache` decodes with it).
    has_decode: ClassVar[bool] = False
    # Source and target must be one vocabulary (their embeddings are one table).
    needs_shared_vocabulary: ClassVar[bool] = False
    # `{field: value}` for each field whose default now means something else than what the family did
    # before the field existed: a run folder's config.json without the field is read with this value,
    # so that it restores into the model it trained (`configs.base.with_defaults`).
    # Every family: its dropout masks were `jax.random.bernoulli`'s before `dropout_masks` existed.
    fields_before: ClassVar[Mapping[str, Any]] = {"dropout_masks": "bernoulli"}
    # `{field: {old value: new value}}` for each value given a new name: a run folder's config.json
    # holding the old one is read with the new (`configs.base.with_defaults`), so that it resumes,
    # evaluates and loads as the run it is.
    renamed_values: ClassVar[Mapping[str, Mapping[Any, Any]]] = {}

    @property
    def length_limit(self) -> int | None:
        """The longest source, target or decoded output (eos included) the model takes; None: any."""
        return None

    def tape_bytes(self, batch: int, length: int) -> int:
        """Device memory the training step holds for `batch` rows of up to `length` tokens beyond
        the parameters and the logits (which every family has; `run_setup.preflight` counts those):
        0 unless the family keeps per-step memory that grows with the length, as LSTMN's tapes."""
        del batch, length
        return 0


@runtime_checkable
class EncoderDecoder(Protocol):
    """What every family implements (an `nnx.Module`).

    `inputs` are what `config.reads` says; `batch` is a dict with `inputs` and `targets` `[B, T]`
    (target ids, right-padded; transformer batches may also carry packing's segment ids and
    positions). `memory` and `state` are pytrees of the family's own making, with a leading batch
    axis on every leaf that beam search may reorder; a node with a `reorder_hypotheses(origins)`
    method reorders itself (`models.layers.Unreordered`, which stays; the Transformer's caches).
    Beam search decodes K hypotheses of each source in K consecutive rows, and repeats the memory
    per row, unless the family reads one memory row per source (`memory_per_source = True`).
    Every attention module carries an `AttentionRole` (`config.roles` lists them), so that
    `attention.capture_attention(model, batch)` and `attention.attention_roles(model)` give each
    one's weights `[B, N, T or S, S]` and what they relate.
    """

    config: ModelConfig

    def __call__(self, batch: Mapping[str, Array], deterministic: bool = True) -> Array:
        """Teacher-forced logits `[B, T, V]` for `batch["targets"]` given `batch["inputs"]`."""
        ...

    def encode(self, inputs: Array) -> Any:
        """The source, once: `inputs` -> the memory every decoder step reads."""
        ...

    def init_decode_state(self, memory: Any, batch_size: int, max_len: int) -> Any:
        """The decoder's state before the first step, for `batch_size` rows of up to `max_len` steps."""
        ...

    def decode_step(self, memory: Any, token: Array, state: Any) -> tuple[Array, Any]:
        """One step: `token [B]` (the previous output, bos first) -> `(logits [B, V], state)`, the state
        of the same structure and shapes as `init_decode_state`'s (a `lax.while_loop` carries it)."""
        ...


@runtime_checkable
class OwnObjective(Protocol):
    """A family with `config.has_objective`: trained by its own loss (the captioner's regularisers and
    hard attention's estimator), not by the trainer's token loss."""

    def initial_model_state(self) -> dict[str, Array]:
        """What the train step carries besides the parameters (checkpointed with them); may be empty."""
        ...

    def objective(
        self, batch: Mapping[str, Array], model_state: dict, key: Array, token_sums
    ) -> tuple[Array, dict, dict]:
        """`(summed loss to minimise, token sums, next model state)`; `token_sums(logits, targets)` is the
        trainer's likelihood (label smoothing included)."""
        ...


@runtime_checkable
class TeacherForcedDecoder(Protocol):
    """A family with `config.has_decode`."""

    def decode(self, targets: Array, memory: Any) -> Array:
        """Teacher-forced logits `[B, T, V]` for `targets [B, T]` given `encode`'s memory."""
        ...


@runtime_checkable
class ImageGrid(Protocol):
    """A family whose `config.reads == "pixels"`: where its annotation cells lie in the image."""

    def grid_shape(self, height: int, width: int) -> tuple[int, int]:
        """The annotation grid `(rows, columns)` of a `height x width` image; L = rows * columns."""
        ...

    def cell_centres(self, height: int, width: int) -> np.ndarray:
        """`[L, 2]` pixel coordinates `(x, y)` of each annotation cell's centre, in the memory's order."""
        ...
