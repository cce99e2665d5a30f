"""The score registry: every evaluation score declared once, with its name, direction, the tasks
it applies to, a one-line description and how it is computed.

Three kinds of score, by where their inputs are:

- loss-side (`loss`, `perplexity`, `token_accuracy`): from the token sums of every target
  token, in `metrics.summarize`;
- text (`exact_match`, `symbol_accuracy`, `bleu`, `bleu_1`..`bleu_4`, `chrf`): from the decoded
  texts and their references; `compute` states each one and `text_scores` runs those that apply;
- attention-side (`alignment_accuracy`, `localization_accuracy`): from attention weights, in
  `engine/evaluation.py` with `metrics.alignment_accuracy` / `metrics.localization_counts`.

`computed_by` names the function of the loss- and attention-side ones; the math of all of them
is in `scoring/metrics.py`. Besides the scores, an evaluation writes a few notes (`NOTES`: counts, the
per-length scores) and the signature of each score that has one (`bleu_signature`,
`chrf_signature`).

A score applies to tasks by tag: a task's tags are its metric (`Task.metric`: "exact_match",
"bleu" for translation, "caption") and "alignment" / "boxes" where the task knows its
alignments or its words' boxes. Adding a score is one `register(Score(...))` here (and its
math in scoring/metrics.py where sacreBLEU or a line does not suffice): `text_scores`, the best_metric
check, the sweep's objective choices and the README's table (`markdown_table`) follow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from scoring import metrics
from utils.errors import ConfigError

# Tags of the tasks a score applies to: the task metrics, and what a task may know besides.
# text scored by exact match: dates, copy, reverse, sort, addition
EXACT = "exact_match"
TRANSLATION = "bleu"
CAPTIONING = "caption"
# tasks that know their alignment spans (dates)
ALIGNED = "alignment"
# captioning tasks that know their words' boxes (digit_strips)
BOXED = "boxes"
TASK_METRICS = (EXACT, TRANSLATION, CAPTIONING)
ALL_TASKS = frozenset(TASK_METRICS)
# tag -> how the README says it
TAGS = {
    EXACT: "exact-match tasks",
    TRANSLATION: "translation",
    CAPTIONING: "captioning",
    ALIGNED: "tasks with alignments",
    BOXED: "captioning with word boxes",
}


@dataclasses.dataclass(frozen=True)
class Texts:
    """What a text score reads: the decoded hypotheses, each one's references (one or several),
    and the BLEU tokenizer. Computations that several scores share (BLEU of an order, chrF) run
    once per `Texts`."""

    hypotheses: tuple[str, ...]
    references: tuple[tuple[str, ...], ...]
    bleu_tokenize: str = "13a"
    _done: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls, hypotheses: Sequence[str], references: Sequence[str | Sequence[str]], bleu_tokenize: str = "13a"
    ) -> Texts:
        """Each reference a string, or a sequence of strings (captioning: every caption of an image)."""
        if len(hypotheses) != len(references):
            raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
        refs = tuple((r,) if isinstance(r, str) else tuple(r) for r in references)
        return cls(tuple(hypotheses), refs, bleu_tokenize)

    def single_references(self) -> list[str]:
        """The one reference of each hypothesis; a score defined for one reference only asks for these."""
        if any(len(r) != 1 for r in self.references):
            raise ValueError("this score needs exactly one reference per hypothesis")
        return [r[0] for r in self.references]

    def bleu(self, order: int = 4) -> tuple[float, str]:
        """`metrics.bleu` over n-grams up to `order`: (score, signature)."""
        return self._once(
            ("bleu", order), lambda: metrics.bleu(self.hypotheses, self.references, self.bleu_tokenize, order)
        )

    def chrf(self) -> tuple[float, str]:
        """`metrics.chrf`: (score, signature)."""
        return self._once(("chrf",), lambda: metrics.chrf(self.hypotheses, self.references))

    def _once(self, key: tuple, compute: Callable[[], Any]) -> Any:
        if key not in self._done:
            self._done[key] = compute()
        return self._done[key]


@dataclasses.dataclass(frozen=True)
class Score:
    """One evaluation score.

    Attributes:
      name: the key in eval/step_<N>.json and metrics.jsonl (and for best_metric, the sweep objective).
      larger_is_better: its direction.
      applies_to: the tags of the tasks it applies to (`TAGS`); `ALL_TASKS` for all.
      description: one line for the README.
      compute: a text score: `Texts -> float`; `text_scores` calls it.
      signature: a text score with a signature: `Texts -> str`, written as `<name>_signature`.
      computed_by: a loss- or attention-side score: the function that computes it where its
        arrays are (exactly one of `compute` and `computed_by`).
      keyed_by: also written as `<name>/<key>`, one per key (`alignment_accuracy/<module>`).
    """

    name: str
    larger_is_better: bool
    applies_to: frozenset[str]
    description: str
    compute: Callable[[Texts], float] | None = None
    signature: Callable[[Texts], str] | None = None
    computed_by: Callable | None = None
    keyed_by: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "applies_to", _tags(self.name, self.applies_to))
        _check_name_and_description(self.name, self.description)
        if not isinstance(self.larger_is_better, bool):
            raise ValueError(f"score {self.name}: larger_is_better must be True or False")
        if (self.compute is None) == (self.computed_by is None):
            raise ValueError(f"score {self.name}: give exactly one of compute (a text score) and computed_by")
        if self.compute is not None and not self.applies_to <= ALL_TASKS:
            raise ValueError(
                f"score {self.name}: a text score applies to task metrics only ({', '.join(TASK_METRICS)})"
            )
        if self.signature is not None and self.compute is None:
            raise ValueError(f"score {self.name}: only a text score has a signature")

    @property
    def direction(self) -> str:
        """The sweep's word for it: "maximize" or "minimize"."""
        return "maximize" if self.larger_is_better else "minimize"


@dataclasses.dataclass(frozen=True)
class Note:
    """A value an evaluation writes beside the scores that is not a score (a count, a breakdown)."""

    name: str
    applies_to: frozenset[str]
    description: str

    def __post_init__(self):
        object.__setattr__(self, "applies_to", _tags(self.name, self.applies_to))
        _check_name_and_description(self.name, self.description)


SCORES: dict[str, Score] = {}
NOTES: dict[str, Note] = {}


def register(entry: Score | Note) -> Score | Note:
    """Adds a score (or a note) to the registry; a name already written by another entry is refused."""
    if entry.name in known_names():
        raise ValueError(f"{entry.name!r} is registered already")
    if isinstance(entry, Score) and entry.signature is not None and f"{entry.name}_signature" in known_names():
        raise ValueError(f"{entry.name}_signature is registered already")
    (SCORES if isinstance(entry, Score) else NOTES)[entry.name] = entry
    return entry


def known_names() -> set[str]:
    """Every key an evaluation may write at the top of its results (keyed scores: their base name)."""
    signatures = {f"{s.name}_signature" for s in SCORES.values() if s.signature is not None}
    return set(SCORES) | set(NOTES) | signatures


def is_known(key: str) -> bool:
    """Whether `key` of eval/step_<N>.json is declared here: a score, `<score>/<key>`, a signature or a note."""
    return key in known_names() or _score_of_keyed_name(key) is not None


def lookup(name: str) -> Score:
    """The score `name` (`alignment_accuracy/<module>`: `alignment_accuracy`); ConfigError listing them all."""
    score = SCORES.get(name) or _score_of_keyed_name(name)
    if score is None:
        raise ConfigError(f"unknown score {name!r}; valid: {', '.join(SCORES)}")
    return score


def larger_is_better(name: str) -> bool:
    return lookup(name).larger_is_better


def task_tags(task_metric: str, *, alignment: bool = False, boxes: bool = False) -> frozenset[str]:
    """A task's tags: its metric ("exact_match", "bleu" or "caption"), and what it knows besides."""
    if task_metric not in TASK_METRICS:
        raise ValueError(f"unknown task metric {task_metric!r}; valid: {', '.join(TASK_METRICS)}")
    return frozenset({task_metric} | ({ALIGNED} if alignment else set()) | ({BOXED} if boxes else set()))


def applicable(task_metric: str, *, alignment: bool = False, boxes: bool = False) -> list[Score]:
    """The scores an evaluation of such a task writes, in registration order."""
    tags = task_tags(task_metric, alignment=alignment, boxes=boxes)
    return [score for score in SCORES.values() if score.applies_to & tags]


def text_scores(
    task_metric: str,
    hypotheses: Sequence[str],
    references: Sequence[str | Sequence[str]],
    *,
    bleu_tokenize: str = "13a",
    signatures: bool = True,
) -> dict[str, Any]:
    """Every registered text score that applies to `task_metric`, each followed by its signature
    (none with `signatures=False`: the per-length scores).

    Args:
      task_metric: `Task.metric`, "exact_match", "bleu" or "caption".
      hypotheses: the decoded texts.
      references: each hypothesis's reference, or its references (`Task.references` gives these
        for every task).
      bleu_tokenize: sacreBLEU's tokenizer (`metrics.BLEU_TOKENIZERS`).
    """
    texts = Texts.of(hypotheses, references, bleu_tokenize)
    results: dict[str, Any] = {}
    for score in applicable(task_metric):
        if score.compute is None:
            continue
        results[score.name] = score.compute(texts)
        if signatures and score.signature is not None:
            results[f"{score.name}_signature"] = score.signature(texts)
    return results


def check_best_metric(
    name: str, task_metric: str, *, alignment: bool = False, boxes: bool = False, field: str = "best_metric"
) -> Score:
    """The score `name` if such a task writes it; otherwise a ConfigError naming `field` and the score,
    and listing the valid names for the task."""
    tags = task_tags(task_metric, alignment=alignment, boxes=boxes)
    valid = [s.name for s in applicable(task_metric, alignment=alignment, boxes=boxes)]
    score = SCORES.get(name) or _score_of_keyed_name(name)
    if score is not None and score.applies_to & tags:
        return score
    reason = "is not a score" if score is None else f"applies to {_tags_in_words(score.applies_to)} only"
    raise ConfigError(f"{field} {name!r} {reason}; valid for {_tags_in_words(tags)}: {', '.join(valid)}")


def objective_choices(task_metric: str, *, alignment: bool = False, boxes: bool = False) -> dict[str, str]:
    """The sweep's objective metrics for such a task: score name -> "maximize" or "minimize"."""
    return {s.name: s.direction for s in applicable(task_metric, alignment=alignment, boxes=boxes)}


def markdown_table() -> str:
    """The README's list: every score, then every signature and note written beside them."""
    rows = [
        "| name | better | applies to | what it is |",
        "|---|---|---|---|",
    ]
    for score in SCORES.values():
        shown = f"`{score.name}`" + (f", `{score.name}/<{score.keyed_by}>`" if score.keyed_by else "")
        rows.append(_row(shown, "larger" if score.larger_is_better else "smaller", score.applies_to, score.description))
    for score in SCORES.values():
        if score.signature is not None:
            rows.append(
                _row(f"`{score.name}_signature`", "-", score.applies_to, f"sacreBLEU's signature of `{score.name}`")
            )
    for note in NOTES.values():
        rows.append(_row(f"`{note.name}`", "-", note.applies_to, note.description))
    return "\n".join(rows) + "\n"


def _row(name: str, better: str, applies_to: frozenset[str], description: str) -> str:
    return f"| {name} | {better} | {_tags_in_words(applies_to)} | {description.replace('|', chr(92) + '|')} |"


def _tags_in_words(tags: frozenset[str]) -> str:
    """Tags as the README says them, in `TAGS` order; all three task metrics: "all tasks"."""
    if ALL_TASKS <= tags:
        return "all tasks"
    return ", ".join(TAGS[t] for t in TAGS if t in tags)


def _score_of_keyed_name(name: str) -> Score | None:
    """`<score>/<key>` of a keyed score: the score."""
    base, slash, key = name.partition("/")
    score = SCORES.get(base)
    return score if slash and key and score is not None and score.keyed_by else None


def _tags(name: str, applies_to: Iterable[str]) -> frozenset[str]:
    tags = frozenset([applies_to] if isinstance(applies_to, str) else applies_to)
    if not tags or not tags <= set(TAGS):
        raise ValueError(f"{name}: applies_to must be some of {', '.join(TAGS)}, got {sorted(tags)}")
    return tags


def _check_name_and_description(name: str, description: str) -> None:
    if not name or not name.replace("_", "").isalnum() or name.endswith("_signature"):
        raise ValueError(f"bad score name {name!r}: letters, digits and _, not ending in _signature")
    if not description.strip() or "\n" in description:
        raise ValueError(f"{name}: the description is one line")


# The scores. Loss-side: over every target token, teacher forced.
register(
    Score(
        "loss",
        False,
        ALL_TASKS,
        "negative log-likelihood per target token (no label smoothing)",
        computed_by=metrics.summarize,
    )
)
register(Score("perplexity", False, ALL_TASKS, "`exp(loss)`", computed_by=metrics.summarize))
register(
    Score(
        "token_accuracy",
        True,
        ALL_TASKS,
        "share of target tokens whose logit is the largest (one of k tied largest: 1/k)",
        computed_by=metrics.summarize,
    )
)

# Text: the decoded outputs against their references.
register(
    Score(
        "exact_match",
        True,
        ALL_TASKS,
        "share of outputs equal to their reference (captioning: to any of them)",
        compute=lambda t: metrics.exact_match(t.hypotheses, t.references),
    )
)
register(
    Score(
        "symbol_accuracy",
        True,
        {EXACT},
        "share of symbols right at their position, over the longer of output and reference",
        compute=lambda t: metrics.symbol_accuracy(t.hypotheses, t.single_references()),
    )
)
register(
    Score(
        "bleu",
        True,
        {TRANSLATION, CAPTIONING},
        "corpus BLEU-4 (sacreBLEU, tokenizer `metrics.bleu_tokenize`; captioning: over all references of an image)",
        compute=lambda t: t.bleu(4)[0],
        signature=lambda t: t.bleu(4)[1],
    )
)
for _order in range(1, 5):
    register(
        Score(
            f"bleu_{_order}",
            True,
            {CAPTIONING},
            f"corpus BLEU over n-grams up to {_order} and all references of an image, as Xu et al. report it",
            compute=lambda t, order=_order: t.bleu(order)[0],
        )
    )
del _order
register(
    Score(
        "chrf",
        True,
        {TRANSLATION},
        "corpus chrF (sacreBLEU)",
        compute=lambda t: t.chrf()[0],
        signature=lambda t: t.chrf()[1],
    )
)

# Attention-side: the attention of a teacher-forced pass (heads averaged) against what the task knows.
register(
    Score(
        "alignment_accuracy",
        True,
        {ALIGNED},
        "share of aligned target positions whose most-attended source position is in the true span; "
        "mean over cross-attention modules",
        computed_by=metrics.alignment_accuracy,
        keyed_by="module",
    )
)
register(
    Score(
        "localization_accuracy",
        True,
        {BOXED},
        "share of caption words whose most-attended cell's centre is in the word's box "
        "(captions with as many words as boxes; word tokenizer)",
        computed_by=metrics.localization_counts,
    )
)

# Notes: written beside the scores.
register(Note("decoded_examples", ALL_TASKS, "how many examples were decoded for the text scores"))
register(Note("localized_words", {BOXED}, "how many caption words `localization_accuracy` scored"))
register(
    Note(
        "by_source_length",
        {EXACT, TRANSLATION},
        "--mode=predict: the text scores per bucket of source tokens, each with its `examples`",
    )
)
