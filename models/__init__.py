"""Models: attention math and modules, shared layers, one file per family, their interface, the registry."""

# Model registry: `config.model.name` -> (hyperparameter dataclass, model class).
#
# Models import nothing of training or data; the trainer builds one with
# `create_model(name, rngs=..., **fields)`. Each family's fields, their defaults
# and documentation live in its dataclass; `configs/base.py` `model()` starts
# from `fields_of(name)`.
#
# Every family is an `EncoderDecoder` and its dataclass a `ModelConfig`, which
# declares what the family does beyond that (`models/interface.py`).

from __future__ import annotations

import dataclasses

from flax import nnx

from models.captioner import Captioner, CaptionerConfig
from models.interface import EncoderDecoder, ImageGrid, ModelConfig, OwnObjective, TeacherForcedDecoder  # noqa: F401 (the interface)
from models.lstmn import LSTMN, LSTMNConfig
from models.rnn import Luong, LuongConfig, RNNEncDec, RNNEncDecConfig, RNNSearch, RNNSearchConfig
from models.transformer import Transformer, TransformerConfig
from utils.errors import ConfigError

MODELS = {
    "transformer": (TransformerConfig, Transformer),
    "rnnencdec": (RNNEncDecConfig, RNNEncDec),
    "rnnsearch": (RNNSearchConfig, RNNSearch),
    "luong": (LuongConfig, Luong),
    "lstmn": (LSTMNConfig, LSTMN),
    "captioner": (CaptionerConfig, Captioner),
}


# Fields that come from the vocabulary, not from the config.
FROM_VOCABULARY = ("vocab_size", "source_vocab_size", "bos_id", "pad_id")
# a deeper stack is a typo, and would take minutes to build
MAX_LAYERS = 1000


def _family(name: str) -> tuple[type, type]:
    if name not in MODELS:
        raise ConfigError(f"unknown model.name {name!r}; valid: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def fields_of(name: str) -> dict:
    """The config fields of model `name` with their defaults (the vocabulary's fields left out)."""
    config_class, _ = _family(name)
    return {f.name: f.default for f in dataclasses.fields(config_class) if f.name not in FROM_VOCABULARY}


def fields_before(name: str) -> dict:
    """What a saved config of model `name` without a field meant by its absence (`ModelConfig.fields_before`)."""
    return dict(_family(name)[0].fields_before)


def with_new_value_names(name: str, fields: dict) -> dict:
    """A saved config's model `fields` with each old value name the family renamed read as its new
    one (`ModelConfig.renamed_values`)."""
    renamed = _family(name)[0].renamed_values
    return {field: renamed[field].get(value, value) if field in renamed else value for field, value in fields.items()}


def checked_config(name: str, **fields):
    """The hyperparameter dataclass of model `name` built from config fields alone (the vocabulary's
    fields as placeholders), so that every field is checked before anything is built or written."""
    config_class, _ = _family(name)
    unknown = sorted(set(fields) - set(fields_of(name)))
    if unknown:
        raise ConfigError(
            f"unknown field(s) for model {name!r}: {', '.join(unknown)}; valid: {', '.join(sorted(fields_of(name)))}"
        )
    # before a huge depth makes building even an abstract model slow
    for field, value in fields.items():
        if field.startswith("num_") and field.endswith("layers") and isinstance(value, int) and value > MAX_LAYERS:
            raise ConfigError(f"model.{field} must be at most {MAX_LAYERS}, got {value}")
    return config_class(vocab_size=1, **fields)


def create_model(name: str, *, rngs: nnx.Rngs, **fields) -> EncoderDecoder:
    """Builds the model registered as `name` from its hyperparameters.

    Raises:
      ConfigError: naming an unknown model, an unknown hyperparameter or an impossible value.
    """
    config_class, model_class = _family(name)
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(
            f"unknown field(s) for model {name!r}: {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
        )
    return model_class(config_class(**fields), rngs=rngs)


# ModelConfig.reads -> run_setup.input_kinds.KINDS
SOURCE_KINDS = {"tokens": "text", "pixels": "image", "features": "features"}


def source_kind_of(name: str, fields: dict) -> str:
    """The kind of source model `name` with `fields` reads (see run_setup/input_kinds.py), as its dataclass
    declares (`ModelConfig.reads`): "text" for the translation families; the captioner reads
    "image"s or, with `inputs="features"`, "features"."""
    return SOURCE_KINDS[checked_config(name, **fields).reads]
