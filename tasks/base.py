"""What every task builder shares: text-pair features, parameter-named configs, build-or-reuse.

A task is a TFDS builder whose examples are `{'source': text, 'target': text}`
(plus task-specific extras such as the dates' alignment spans), written once to
array_record files under `data_dir` and read back with random access. The
builder config's name is made from its parameters, so changing a parameter (or
the builder's VERSION) builds a new copy instead of reusing a stale one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any, ClassVar, Iterable, Mapping

import tensorflow_datasets as tfds

from errors import ConfigError

SPLITS = ("train", "dev", "test")


@dataclasses.dataclass(eq=False)
class TaskConfig(tfds.core.BuilderConfig):
    """Base of the task parameters; subclasses add fields. The name is derived from them."""

    def parameters(self) -> dict[str, Any]:
        base = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in base}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every parameter with its default (what `configs/base.py` `task()` starts from)."""
        base = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in base}

    @classmethod
    def create(cls, **params) -> "TaskConfig":
        """A config whose name is a digest of its parameters, e.g. `p3f9c2a1b0d4e`."""
        known = {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"unknown task parameter(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        config = cls(name="pending", **params)
        digest = hashlib.sha256(json.dumps(config.parameters(), sort_keys=True, default=str).encode()).hexdigest()
        config.name = "p" + digest[:12]
        config.description = json.dumps(config.parameters(), sort_keys=True, default=str)
        return config


class TextPairBuilder(tfds.core.GeneratorBasedBuilder):
    """A builder of `{'source', 'target'}` text pairs, one generator per split.

    Subclasses set `VERSION` and `BUILDER_CONFIG_CLASS`, may add `EXTRA_FEATURES`,
    and implement `_split_examples() -> {split: iterable of examples}`.
    They may record a build report (e.g. skipped lines) in `self.build_report`;
    it is stored with the data and logged whenever the data is loaded.
    """

    EXTRA_FEATURES: ClassVar[Mapping[str, tfds.features.FeatureConnector]] = {}

    def __init__(self, *, config: TaskConfig, data_dir: str):
        self.build_report: dict[str, Any] = {}
        super().__init__(config=config, data_dir=data_dir, file_format="array_record")

    def _features(self) -> dict[str, tfds.features.FeatureConnector]:
        """An example's features (image tasks replace the text pair)."""
        return {"source": tfds.features.Text(), "target": tfds.features.Text(), **self.EXTRA_FEATURES}

    def _info(self) -> tfds.core.DatasetInfo:
        features = self._features()
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.__doc__,
            features=tfds.features.FeaturesDict(features),
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,  # keep generation order: index i is the i-th example
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # everything is generated or read locally
        return {split: enumerate(examples) for split, examples in self._split_examples().items()}

    def _generate_examples(self, **kwargs):  # required by TFDS; _split_generators bypasses it
        raise NotImplementedError

    def _split_examples(self) -> dict[str, Iterable[dict[str, Any]]]:
        raise NotImplementedError

    def _download_and_prepare(self, dl_manager, download_config=None):
        super()._download_and_prepare(dl_manager, download_config)
        self.info.metadata["build_report"] = self.build_report


def prepare(builder_class: type[TextPairBuilder], data_dir: str, **params) -> tuple[dict[str, Any], dict]:
    """Builds the task's data unless a copy with the same version and parameters exists.

    Returns:
      `({split: random-access source of examples}, build report)`.
    """
    builder = builder_class(config=builder_class.BUILDER_CONFIG_CLASS.create(**params), data_dir=data_dir)
    builder.download_and_prepare()
    report = dict(builder.info.metadata.get("build_report", {}))
    return builder.as_data_source(), report


def text(value: bytes | str) -> str:
    """TFDS returns Text features as bytes."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def log_report(name: str, report: Mapping[str, Any]) -> None:
    for line in report.get("messages", []):
        logging.warning("task %s: %s", name, line)

