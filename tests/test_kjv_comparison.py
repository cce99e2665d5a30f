"""benchmarks/kjv_comparison.py's seed summary on hand-made outputs: the columns ranked by mean
BLEU, each tested against the leader and the column just above, and "order varies" or "reversed" exactly
where some seed or every seed ranks a pair the other way."""

import json

import sacrebleu

from benchmarks import kjv_comparison

SENTENCES = 40
REFERENCES = [" ".join(f"w{i}{part}" for part in "abcde") for i in range(SENTENCES)]


def outputs(exact: int, near_misses: bool) -> list[str]:
    """The first `exact` sentences as their references, the rest sharing no word with theirs: two
    unrelated words, or (`near_misses`) each of the five words with its first letter changed, which
    chrF scores highly and BLEU not at all."""
    wrong = [
        " ".join(f"v{i}{part}" for part in "abcde") if near_misses else f"zz{i} yy{i}" for i in range(exact, SENTENCES)
    ]
    return REFERENCES[:exact] + wrong


def row(tmp_path, column: str, seed: int, exact: int) -> kjv_comparison.Row:
    workdir = tmp_path / f"{column}_{seed}"
    workdir.mkdir()
    hypotheses = outputs(exact, near_misses=column == "reversed")
    (workdir / "test_hypotheses.json").write_text(json.dumps(list(enumerate(hypotheses))))
    test = {
        "bleu": sacrebleu.corpus_bleu(hypotheses, [REFERENCES]).score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, [REFERENCES]).score,
    }
    return kjv_comparison.Row(
        column=column,
        seed=seed,
        rate=1e-3,
        tuned=True,
        plan={},
        trained={},
        epochs=1.0,
        test=test,
        parameters=1,
        workdir=workdir,
    )


def test_seed_summary_ranks_the_columns_and_flags_a_pair_whose_order_varies_by_seed(tmp_path, capsys):
    # exact sentences of 40 at seeds 0 and 1: `lower` beats `middle` at seed 1 (25 against 20) but
    # ranks below it on the mean BLEU (62.5 against 68.1; a wrong sentence scores nothing, and BLEU's
    # brevity penalty counts its 2 words against 5); `reversed` is below `lower` in BLEU at both
    # seeds but above it in chrF at both (its wrong sentences share characters with the references)
    # (BLEU 45.0 and 60.0 against 56.6 and 68.5; chrF 56.0 and 68.0 against 52.8 and 65.3)
    exact = {"lower": (20, 25), "leader": (40, 40), "reversed": (18, 24), "middle": (30, 20)}
    rows = [row(tmp_path, column, seed, n) for column, counts in exact.items() for seed, n in enumerate(counts)]
    kjv_comparison.print_seed_summary(rows, (REFERENCES, REFERENCES, "13a"))
    table = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    cells = {cells[0].strip(): [cell.strip() for cell in cells[1:]] for cells in table[1:]}
    assert list(cells) == ["leader", "middle", "lower", "reversed"]
    # the leader: 100 at both seeds, no spread, nothing to test against
    assert cells["leader"] == ["2", "100.00 (0.00)", "100.00 (0.00)", "", "", "", ""]
    # the second's column above is the leader: tested once
    middle_p = cells["middle"][3:]
    assert middle_p[2:] == ["", ""] and all(float(p) <= 0.01 for p in middle_p[:2])
    # against the leader the order holds at both seeds; against `middle` it does not
    lower_p = cells["lower"][3:]
    assert "order varies" not in lower_p[0] + lower_p[1]
    assert all(p.endswith("(order varies)") for p in lower_p[2:])
    # below `lower` in BLEU at both seeds, above it in chrF at both
    reversed_p = cells["reversed"][3:]
    assert not reversed_p[2].endswith(")") and reversed_p[3].endswith("(reversed)")
