"""Searching and scoring with a restored run: `Translator` (made by `inference.load`).

It holds the run, the restored step and parameters; the searches it compiles, one per decode
settings; and what differs by input kind, which the run's source kind (run_setup/input_kinds.py) decides.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import attention_roles, capture_attention
from report import pictures
from run_setup.input_kinds import padded_ids
from run_setup.run import Run
from run_setup.settings import DecodeSettings, Settings
from scoring import decoding
from tasks.vocabularies import EOS_ID, PAD_ID
from utils import progress
from utils.errors import UserError

# sources decoded together; batches are padded to this many rows (one compilation)
BATCH_ROWS = 32


class Translator:
    """A trained model with its vocabulary and search; see the module docstring."""

    def __init__(self, run: Run, step: int, params):
        self.run, self.step, self.params = run, step, params
        self.roles = attention_roles(run.model(params))
        # compiled searches by decode settings
        self._searches: dict[tuple, object] = {}
        # text, images or feature grids
        self.kind = run.settings.source

    @property
    def settings(self) -> Settings:
        return self.run.settings

    def _target_ids(self, targets: Sequence[str]) -> list[np.ndarray]:
        ids = [np.append(self.run.tokens.target.encode(text), EOS_ID).astype(np.int32) for text in targets]
        # learned positions, LSTMN tapes
        limit = self.settings.model.hyperparameters.length_limit
        if limit is not None and max(map(len, ids)) > limit:
            raise UserError(f"a target of {max(map(len, ids))} tokens is longer than model.max_length = {limit}")
        return ids

    def _search(self, settings: DecodeSettings):
        """The search compiled for these decode settings (kept on this translator, one per settings)."""
        if settings not in self._searches:
            run, options = self.run, settings.search_options()
            length = self.settings.output_length(settings.max_length_offset)

            @jax.jit
            def search(params, inputs, key):
                return decoding.decode(run.searching_model(params), inputs, length=length, key=key, **options)

            self._searches[settings] = search
        return self._searches[settings]

    @property
    def _length_limit(self) -> int:
        """The longest padded row: the data limits (learned positions end there)."""
        return max(self.settings.data.max_source_length, self.settings.data.max_target_length)

    def _source_rows(self, sources: Sequence) -> list[np.ndarray]:
        """Each source as the model reads it (token ids, an image `[H, W, C]` uint8, a feature grid), checked."""
        return self.kind.user_rows(
            sources, self.settings.model.fields, self.run.tokens, self.settings.data.max_source_length
        )

    def _source_batch(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        return self.kind.user_batch(rows, BATCH_ROWS, self._length_limit)

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
        search = self._search(self.settings.decode.with_options(**decode_options))
        # sampling: one key per batch, so a sample depends on its batch
        key = jax.random.key(self.settings.seed + 3)
        rows = self._source_rows(sources)
        # Sources of similar length decode together: a batch's search runs until its longest
        # output ends, and its sources are padded to the next power of two of its longest.
        order = np.argsort([len(row) for row in rows], kind="stable") if self.kind.has_length else np.arange(len(rows))
        outputs = [None] * len(rows)
        # a progress phase when there are several (--mode=predict --input_file)
        batches = range(0, len(rows), BATCH_ROWS)
        for start in progress.track(batches, "decoding", unit="batches", enabled=len(batches) > 1):
            chunk = order[start : start + BATCH_ROWS]
            batch = jnp.asarray(self._source_batch([rows[i] for i in chunk]))
            tokens, scores = search(self.params, batch, jax.random.fold_in(key, start))
            for i, row_tokens, row_scores in zip(chunk, np.asarray(tokens), np.asarray(scores)):
                outputs[i] = [
                    (ids[: int(np.argmax(ids == EOS_ID)) + 1], float(score))
                    for ids, score in zip(row_tokens, row_scores)
                    if score > decoding.NEVER / 2
                ]
        return outputs

    @functools.cached_property
    def _log_probs(self):
        run = self.run

        @jax.jit
        def log_probs(params, batch):
            logits = run.model(params)(batch, deterministic=True)
            token_log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1)[
                ..., 0
            ]
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
            outputs = padded_ids(target_ids[start : start + BATCH_ROWS], BATCH_ROWS, self._length_limit)
            batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(outputs)}
            scores.append(
                np.asarray(self._log_probs(self.params, batch))[: len(source_ids[start : start + BATCH_ROWS])]
            )
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
        return pictures.example_weights(weights, self.roles, 0, self.kind.source_length(inputs), len(output))

    def draw_attention(self, source, directory: Path, *, self_attention: bool = False) -> str:
        """Decodes `source` and draws its attention into `directory`; returns the output text."""
        inputs, output = self._attention_inputs(source, None)
        # the decoded ids themselves, not their text re-encoded
        weights = self._attention_of(inputs, output)
        tokens = self.run.tokens
        self.kind.draw(
            directory,
            f"step_{self.step}",
            inputs,
            weights,
            self.roles,
            tokens.target.pieces(output),
            tokens,
            self.run.model(self.params),
            self_attention=self_attention,
        )
        return tokens.target.decode(output)
