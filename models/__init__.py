"""Model registry: `config.model.name` -> (hyperparameter dataclass, model class).

Models import nothing of training or data; the trainer builds one with
`create_model(name, rngs=..., **fields)`.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from models.rnn import Luong, LuongConfig, RNNEncDec, RNNEncDecConfig, RNNSearch, RNNSearchConfig
from models.transformer import Transformer, TransformerConfig

MODELS = {
    "transformer": (TransformerConfig, Transformer),
    "rnnencdec": (RNNEncDecConfig, RNNEncDec),
    "rnnsearch": (RNNSearchConfig, RNNSearch),
    "luong": (LuongConfig, Luong),
}


def create_model(name: str, *, rngs: nnx.Rngs, **fields) -> nnx.Module:
    """Builds the model registered as `name` from its hyperparameters.

    Raises:
      ValueError: naming an unknown model or an unknown hyperparameter.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model.name {name!r}; valid: {', '.join(sorted(MODELS))}")
    config_class, model_class = MODELS[name]
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown field(s) for model {name!r}: {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    return model_class(config_class(**fields), rngs=rngs)
