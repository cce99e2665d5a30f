"""The score registry against hand-worked values and sacrebleu called directly."""

import math

import pytest
import sacrebleu

from scoring import metrics, score_registry
from utils.errors import ConfigError

HYPOTHESES = ["the cat sat on the mat", "a dog barked", "it rains"]
REFERENCES = ["the cat sat on a mat", "the dog barked loudly", "it rains"]


def sacrebleu_bleu(hypotheses, streams, **options):
    """sacreBLEU's corpus BLEU and signature over reference streams given by hand."""
    metric = sacrebleu.BLEU(**options)
    return metric.corpus_score(hypotheses, streams).score, str(metric.get_signature())


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry that a test may add to; the module's is restored afterwards."""
    monkeypatch.setattr(score_registry, "SCORES", dict(score_registry.SCORES))
    monkeypatch.setattr(score_registry, "NOTES", dict(score_registry.NOTES))


def test_translation_text_scores_are_bleu_chrf_their_signatures_and_exact_match():
    results = score_registry.text_scores("bleu", HYPOTHESES, REFERENCES)
    assert set(results) == {"bleu", "chrf", "bleu_signature", "chrf_signature", "exact_match"}
    bleu, bleu_signature = sacrebleu_bleu(HYPOTHESES, [REFERENCES])
    chrf = sacrebleu.CHRF()
    assert results["bleu"] == bleu
    assert (
        results["bleu_signature"]
        == bleu_signature
        == "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" + sacrebleu.__version__
    )
    assert results["chrf"] == chrf.corpus_score(HYPOTHESES, [REFERENCES]).score
    assert results["chrf_signature"] == str(chrf.get_signature())
    # "it rains" only
    assert results["exact_match"] == 1 / 3


def test_bleu_of_one_sentence_by_hand():
    # 6 words each, brevity penalty 1; n-gram precisions 5/6, 3/5, 2/4, 1/3: BLEU = (1/12)^(1/4)
    results = score_registry.text_scores("bleu", ["the cat sat on the mat"], ["the cat sat on a mat"])
    assert math.isclose(results["bleu"], 100 * (1 / 12) ** 0.25, rel_tol=1e-12)
    assert results["exact_match"] == 0.0


def test_the_bleu_tokenizer_reaches_bleu_and_its_signature_only():
    hypotheses, references = ["猫が座った。"], ["猫が座った"]
    results = score_registry.text_scores("bleu", hypotheses, references, bleu_tokenize="char")
    assert (results["bleu"], results["bleu_signature"]) == sacrebleu_bleu(hypotheses, [references], tokenize="char")
    assert "tok:char" in results["bleu_signature"]
    assert results["chrf"] == score_registry.text_scores("bleu", hypotheses, references)["chrf"]


def test_exact_match_task_scores_are_exact_match_and_symbol_accuracy():
    # "abc" = "abc"; "abd" vs "abc": 2 of 3 symbols; "" vs "x": 0 of 1
    results = score_registry.text_scores("exact_match", ["abc", "abd", ""], ["abc", "abc", "x"])
    assert results == {"exact_match": 1 / 3, "symbol_accuracy": (3 + 2 + 0) / (3 + 3 + 1)}


def test_caption_scores_use_every_reference():
    hypotheses = ["a dog runs", "two cats"]
    references = [["a dog runs fast", "a dog runs"], ["one cat"]]
    results = score_registry.text_scores("caption", hypotheses, references)
    assert set(results) == {"bleu_1", "bleu_2", "bleu_3", "bleu_4", "bleu", "bleu_signature", "exact_match"}
    # 5 hypothesis words, closest reference lengths 3 + 2: no brevity penalty. Matches: unigrams
    # 3 of 5 ("cats" is not "cat"), bigrams 2 of 3, the one trigram; no 4-gram at all.
    assert math.isclose(results["bleu_1"], 100 * 3 / 5, rel_tol=1e-12)
    assert math.isclose(results["bleu_2"], 100 * (3 / 5 * 2 / 3) ** (1 / 2), rel_tol=1e-12)
    assert math.isclose(results["bleu_3"], 100 * (3 / 5 * 2 / 3 * 1) ** (1 / 3), rel_tol=1e-12)
    # sacreBLEU skips None
    streams = [["a dog runs fast", "one cat"], ["a dog runs", None]]
    for order in range(1, 5):
        assert results[f"bleu_{order}"] == sacrebleu_bleu(hypotheses, streams, max_ngram_order=order)[0]
    assert results["bleu"] == results["bleu_4"]
    assert results["bleu_signature"] == sacrebleu_bleu(hypotheses, streams)[1]
    assert "nrefs:var" in results["bleu_signature"]
    # "a dog runs" is the first image's second caption
    assert results["exact_match"] == 1 / 2


def test_one_reference_as_a_string_or_a_list_of_one_scores_the_same():
    as_lists = score_registry.text_scores("bleu", HYPOTHESES, [[r] for r in REFERENCES])
    assert as_lists == score_registry.text_scores("bleu", HYPOTHESES, REFERENCES)
    assert score_registry.text_scores("exact_match", ["ab"], [["ab"]]) == {"exact_match": 1.0, "symbol_accuracy": 1.0}


def test_per_length_scores_leave_the_signatures_out():
    results = score_registry.text_scores("bleu", HYPOTHESES, REFERENCES, signatures=False)
    assert set(results) == {"bleu", "chrf", "exact_match"}


def test_bleu_and_bleu_4_are_computed_once(monkeypatch):
    calls = []

    def counting_bleu(*args):
        calls.append(args[-1])
        return metrics_bleu(*args)

    metrics_bleu = metrics.bleu
    monkeypatch.setattr(metrics, "bleu", counting_bleu)
    score_registry.text_scores("caption", ["a b c d"], [["a b c d"]])
    assert sorted(calls) == [1, 2, 3, 4]


def test_unknown_task_metric_and_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="exact_match, bleu, caption"):
        score_registry.text_scores("rouge", ["a"], ["a"])
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        score_registry.text_scores("bleu", ["a", "b"], ["a"])


@pytest.mark.parametrize(
    "name, task_metric, extra",
    [
        ("loss", "exact_match", {}),
        ("perplexity", "caption", {}),
        ("token_accuracy", "bleu", {}),
        ("exact_match", "caption", {}),
        ("symbol_accuracy", "exact_match", {}),
        ("bleu", "bleu", {}),
        ("bleu", "caption", {}),
        ("bleu_4", "caption", {}),
        ("chrf", "bleu", {}),
        ("alignment_accuracy", "exact_match", {"alignment": True}),
        ("alignment_accuracy/decoder_cross", "exact_match", {"alignment": True}),
        ("localization_accuracy", "caption", {"boxes": True}),
    ],
)
def test_check_best_metric_accepts_the_scores_of_the_task(name, task_metric, extra):
    assert score_registry.check_best_metric(name, task_metric, **extra) is score_registry.lookup(name)


@pytest.mark.parametrize(
    "name, task_metric, extra, said",
    [
        ("bleu", "exact_match", {}, "applies to translation, captioning only"),
        ("chrf", "caption", {}, "applies to translation only"),
        ("symbol_accuracy", "bleu", {}, "applies to exact-match tasks only"),
        ("bleu_1", "bleu", {}, "applies to captioning only"),
        ("alignment_accuracy", "exact_match", {}, "applies to tasks with alignments only"),
        ("localization_accuracy", "caption", {}, "applies to captioning with word boxes only"),
        ("blue", "bleu", {}, "is not a score"),
        ("bleu_signature", "bleu", {}, "is not a score"),
        ("decoded_examples", "bleu", {}, "is not a score"),
        ("loss/encoder", "bleu", {}, "is not a score"),
    ],
)
def test_check_best_metric_refuses_naming_the_score_and_the_valid_ones(name, task_metric, extra, said):
    with pytest.raises(ConfigError) as raised:
        score_registry.check_best_metric(name, task_metric, **extra)
    message = str(raised.value)
    assert message.startswith(f"best_metric {name!r} {said}; valid for ")
    valid = message.split(": ", 1)[1].split(", ")
    assert valid == [s.name for s in score_registry.applicable(task_metric, **extra)]
    assert "loss" in valid and name not in valid


def test_check_best_metric_names_the_field_it_checks():
    with pytest.raises(ConfigError, match="^objective 'bleu' "):
        score_registry.check_best_metric("bleu", "exact_match", field="objective")


def test_valid_names_by_task():
    assert list(score_registry.objective_choices("exact_match", alignment=True)) == [
        "loss",
        "perplexity",
        "token_accuracy",
        "exact_match",
        "symbol_accuracy",
        "alignment_accuracy",
    ]
    assert list(score_registry.objective_choices("bleu")) == [
        "loss",
        "perplexity",
        "token_accuracy",
        "exact_match",
        "bleu",
        "chrf",
    ]
    assert list(score_registry.objective_choices("caption", boxes=True)) == [
        "loss",
        "perplexity",
        "token_accuracy",
        "exact_match",
        "bleu",
        "bleu_1",
        "bleu_2",
        "bleu_3",
        "bleu_4",
        "localization_accuracy",
    ]


def test_directions():
    assert not score_registry.larger_is_better("loss") and not score_registry.larger_is_better("perplexity")
    for name in (
        "token_accuracy",
        "exact_match",
        "symbol_accuracy",
        "bleu",
        "bleu_2",
        "chrf",
        "alignment_accuracy/x",
        "localization_accuracy",
    ):
        assert score_registry.larger_is_better(name), name
    assert (
        score_registry.objective_choices("bleu")["loss"] == "minimize"
        and score_registry.objective_choices("bleu")["bleu"] == "maximize"
    )
    with pytest.raises(ConfigError, match="unknown score 'blue'; valid: loss, perplexity"):
        score_registry.larger_is_better("blue")


def test_every_registered_score_is_declared_in_full():
    assert score_registry.SCORES and score_registry.NOTES
    for name, score in score_registry.SCORES.items():
        assert score.name == name
        assert isinstance(score.larger_is_better, bool)
        assert score.description.strip() and "\n" not in score.description
        assert score.applies_to and score.applies_to <= set(score_registry.TAGS)
        # a text score, or where it is computed
        assert (score.compute is None) != (score.computed_by is None)
        if score.computed_by is not None:
            # the math is in scoring/metrics.py
            assert getattr(metrics, score.computed_by.__name__) is score.computed_by
    for name, note in score_registry.NOTES.items():
        assert note.name == name and note.description.strip() and note.applies_to <= set(score_registry.TAGS)


def test_the_markdown_table_lists_every_score_signature_and_note_once():
    table = score_registry.markdown_table()
    lines = table.splitlines()
    assert lines[0] == "| name | better | applies to | what it is |"
    names = [line.split(" | ")[0].removeprefix("| ") for line in lines[2:]]
    expected = (
        [f"`{n}`" for n in score_registry.SCORES]
        + ["`bleu_signature`", "`chrf_signature`"]
        + [f"`{n}`" for n in score_registry.NOTES]
    )
    expected[list(score_registry.SCORES).index("alignment_accuracy")] += ", `alignment_accuracy/<module>`"
    assert names == expected
    assert "| `loss` | smaller | all tasks | " in table
    assert "| `chrf` | larger | translation | " in table


def test_is_known_covers_every_key_an_evaluation_writes():
    written = [
        "loss",
        "perplexity",
        "token_accuracy",
        "exact_match",
        "bleu",
        "bleu_signature",
        "chrf_signature",
        "decoded_examples",
        "alignment_accuracy",
        "alignment_accuracy/encoder_decoder",
        "localized_words",
        "by_source_length",
    ]
    assert all(score_registry.is_known(key) for key in written)
    assert not any(score_registry.is_known(key) for key in ("step", "bleu/x", "rouge", "symbol_accuracy_signature"))


def test_a_new_score_is_one_registration(registry):
    def length_ratio(texts):
        return sum(map(len, texts.hypotheses)) / sum(len(r[0]) for r in texts.references)

    score_registry.register(
        score_registry.Score(
            "length_ratio",
            False,
            {score_registry.TRANSLATION},
            "output characters per reference character",
            compute=length_ratio,
            signature=lambda texts: "chars",
        )
    )
    results = score_registry.text_scores("bleu", ["abc", "d"], ["ab", "de"])
    assert results["length_ratio"] == 4 / 4 and results["length_ratio_signature"] == "chars"
    assert "length_ratio" not in score_registry.text_scores("exact_match", ["abc"], ["ab"])
    assert score_registry.check_best_metric("length_ratio", "bleu").larger_is_better is False
    with pytest.raises(ConfigError, match="applies to translation only"):
        score_registry.check_best_metric("length_ratio", "caption")
    assert score_registry.objective_choices("bleu")["length_ratio"] == "minimize"
    assert (
        "| `length_ratio` | smaller | translation | output characters per reference character |"
        in score_registry.markdown_table()
    )
    assert "| `length_ratio_signature` | - | translation | " in score_registry.markdown_table()
    assert score_registry.is_known("length_ratio_signature")


def test_the_registry_refuses_a_score_declared_badly(registry):
    with pytest.raises(ValueError, match="registered already"):
        score_registry.register(
            score_registry.Score("bleu", True, {score_registry.TRANSLATION}, "again", compute=lambda t: 0.0)
        )
    with pytest.raises(ValueError, match="registered already"):
        score_registry.register(score_registry.Note("decoded_examples", score_registry.ALL_TASKS, "again"))
    with pytest.raises(ValueError, match="larger_is_better"):
        score_registry.Score("x", None, score_registry.ALL_TASKS, "no direction", compute=lambda t: 0.0)
    with pytest.raises(ValueError, match="one line"):
        score_registry.Score("x", True, score_registry.ALL_TASKS, "", compute=lambda t: 0.0)
    with pytest.raises(ValueError, match="applies_to"):
        score_registry.Score("x", True, {"translation"}, "a tag that does not exist", compute=lambda t: 0.0)
    with pytest.raises(ValueError, match="exactly one of compute"):
        score_registry.Score("x", True, score_registry.ALL_TASKS, "computed nowhere")
    with pytest.raises(ValueError, match="task metrics only"):
        score_registry.Score("x", True, {score_registry.ALIGNED}, "a text score on alignments", compute=lambda t: 0.0)
    with pytest.raises(ValueError, match="bad score name"):
        score_registry.Score("x/y", True, score_registry.ALL_TASKS, "a slash", compute=lambda t: 0.0)


def test_every_value_a_run_writes_is_a_registered_score_or_note(finished_run):
    import json

    _, workdir, _ = finished_run
    for path in (workdir / "eval").glob("step_*.json"):
        for split, results in json.loads(path.read_text()).items():
            if split != "step":
                assert all(score_registry.is_known(key) for key in results), (
                    path.name,
                    [k for k in results if not score_registry.is_known(k)],
                )
