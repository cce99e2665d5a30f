"""The path after training: eval and predict from the run folder, resuming with a checked config,
switching tasks and models from the command line, the inference API, n-best lists, early stopping."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import inference
import train
from configs import base
from engine import evaluation, training_loop
from helpers.tiny import locked_with, tiny_config, xla_flags
from run_setup import compatibility, preflight, settings
from run_setup.cluster import make_mesh
from run_setup.settings import parse
from scoring import score_registry
from tasks.vocabularies import EOS_ID
from utils.errors import ConfigError, UserError

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def train_py(*flags, env=None):
    command = [sys.executable, str(PROJECT_ROOT / "train.py"), *map(str, flags)]
    environment = {**os.environ, "XLA_FLAGS": xla_flags(1), **(env or {})}
    return subprocess.run(command, cwd=PROJECT_ROOT, env=environment, capture_output=True, text=True, timeout=300)


def copy_of(workdir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    return copy


def rows(workdir):
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- eval and predict from the run folder


def test_eval_reads_the_run_folder_and_refuses_another_model(finished_run, tmp_path):
    _, workdir, final = finished_run
    run = copy_of(workdir, tmp_path)
    # what train.py --mode=eval makes of its flags: a UserError, which it prints as one line, exit code 2
    with pytest.raises(UserError, match=re.escape("model.d_model: 16 -> 32")):
        train.settings_for("eval", run, None, ["--config.model.d_model=32"])
    done = train_py(f"--workdir={run}", "--mode=eval", "--config.eval_split=dev", "--config.decode.beam_size=2")
    assert done.returncode == 0, done.stderr
    written = json.loads((run / "eval" / "step_20.json").read_text())["dev"]
    # the whole split: no training-time subset carries over
    assert written["decoded_examples"] == 24
    # same parameters, same data
    assert written["loss"] == pytest.approx(final["dev"]["loss"], rel=1e-6)


def test_evaluation_config_keeps_the_run_and_takes_evaluation_fields(finished_run):
    config, workdir, _ = finished_run
    saved = base.read_run_config(workdir)
    requested = parse(
        base.load(
            saved, ["--config.decode.beam_size=3", "--config.eval_decode_examples=5", "--config.learning_rate=9.0"]
        )
    )
    merged = compatibility.for_evaluation(
        parse(saved), requested, ["decode.beam_size", "eval_decode_examples", "learning_rate"]
    )
    assert (merged.decode.beam_size, merged.evaluation.eval_decode_examples, merged.optimization.learning_rate) == (
        3,
        5,
        saved.learning_rate,
    )
    assert (
        compatibility.for_evaluation(parse(saved), requested, ["decode.beam_size"]).evaluation.eval_decode_examples == 0
    )
    # config.json reads back into the same settings
    assert settings.read_run_settings(workdir) == parse(saved)
    with pytest.raises(ConfigError, match=r"task.train_size: 600 -> 700"):
        compatibility.for_evaluation(
            parse(saved), parse(base.load(saved, ["--config.task.train_size=700"])), ["task.train_size"]
        )


def test_predict_with_an_n_best_list_and_standard_input(finished_run, tmp_path, monkeypatch):
    config, workdir, final = finished_run
    run = copy_of(workdir, tmp_path)
    beam = tiny_config(config.data_dir, **{"decode.beam_size": 3, "decode.num_hypotheses": 2})
    path = evaluation.predict(parse(beam), run)
    n_best = [line.split("\t") for line in path.with_suffix(".nbest.tsv").read_text().splitlines()[1:]]
    assert len(n_best) == 2 * 24 and [r[1] for r in n_best[:4]] == ["1", "2", "1", "2"]
    assert all(float(first[2]) >= float(second[2]) for first, second in zip(n_best[::2], n_best[1::2]))
    best = [line.split("\t")[2] for line in path.read_text().splitlines()[1:]]
    # predictions.tsv holds each source's first
    assert best == [r[3] for r in n_best[::2]]
    monkeypatch.setattr(sys, "stdin", io.StringIO("3 March 2021\n\n12/24/99\n"))
    path = inference.translate_file(parse(config), run, "-")
    assert path.name == "step_20_stdin.tsv" and len(path.read_text().splitlines()) == 3


# ---------------------------------------------------------------- resuming and switching


def test_resuming_with_a_changed_model_is_refused_before_anything_is_written(finished_run, tmp_path):
    config, workdir, _ = finished_run
    run = copy_of(workdir, tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    changed = tiny_config(config.data_dir, **{"model.d_ff": 64, "num_train_steps": 30})
    with pytest.raises(ConfigError, match=r"model.d_ff: 32 -> 64"):
        training_loop.train_and_evaluate(parse(changed), run)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_readme_own_corpus_command(tmp_path):
    """The README's command for one's own corpus, with a tiny model and corpus."""
    corpus = tmp_path / "my"
    corpus.mkdir()
    for split, count in (("train", 60), ("dev", 6), ("test", 6)):
        lines = [f"the {n} cats sat on {n % 7} mats\tdie {n} Katzen sassen auf {n % 7} Matten" for n in range(count)]
        (corpus / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    workdir = tmp_path / "mine"
    result = train_py(
        "--config=configs/kjv_web_transformer.py",
        f"--workdir={workdir}",
        "--config.task.name=parallel_text",
        f"--config.task.train={corpus}/train.tsv",
        f"--config.task.dev={corpus}/dev.tsv",
        f"--config.task.test={corpus}/test.tsv",
        # tiny, so that the test is quick:
        f"--config.data_dir={tmp_path / 'tfds'}",
        "--config.tokenizer.vocab_size=60",
        "--config.model.d_model=16",
        "--config.model.d_ff=32",
        "--config.model.num_heads=2",
        "--config.model.num_encoder_layers=1",
        "--config.model.num_decoder_layers=1",
        # the config's eight microbatches, one row each
        "--config.batch_size=8",
        "--config.num_train_steps=4",
        "--config.warmup_steps=2",
        "--config.eval_every_steps=4",
        "--config.checkpoint_every_steps=4",
        "--config.decode.beam_size=1",
        "--config.visualize_examples=0",
        "--config.data.max_source_length=32",
        "--config.data.max_target_length=32",
        "--config.log_every_steps=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = (workdir / "log.txt").read_text()
    # before the first step
    assert log.index("start-up summary") < log.index("step 2/4")
    assert "data:        train 60 examples, " in log and "dev 6 examples; test 6 examples" in log
    assert re.search(rf"vocabulary:  sentencepiece, \d+ ids, shared in {re.escape(str(workdir / 'tokenizer'))}\n", log)
    # the outputs this run writes (no pictures asked)
    assert "checkpoints/" in log and "attention/" not in log
    # once, at the second log interval
    assert log.count("of training to the end (0 steps at") == 1
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["task"]["name"] == "parallel_text" and saved["task"]["train"].endswith("my/train.tsv")
    assert "bleu" in json.loads((workdir / "eval" / "step_4.json").read_text())["test"]
    # the run's log, in the run folder
    assert "INFO" in (workdir / "log.txt").read_text()
    # TFDS's warning at every start about the task's own builder config (train.UNACTIONABLE_LIBRARY_WARNINGS)
    assert "Using custom data configuration" not in result.stderr, result.stderr[-3000:]


def test_a_runs_log_holds_no_warning_it_cannot_act_on(whole_tiny_run):
    """The whole tiny run saved its checkpoints at 20 and 40 between evaluations, without metrics on
    purpose (only an evaluated one is a candidate for the best): Orbax's warning at each of those
    saves is dropped (train.UNACTIONABLE_LIBRARY_WARNINGS), and the log holds no warning at all."""
    from helpers.subprocess_runs import WHOLE_RUN_FLAGS

    # the premise: saves between evaluations
    assert {"--config.checkpoint_every_steps=20", "--config.eval_every_steps=30"} <= set(WHOLE_RUN_FLAGS)
    log = (whole_tiny_run / "log.txt").read_text()
    assert "tracked_metric" not in log and "WARNING" not in log, log


def test_switching_task_or_model_in_any_order_and_misspelt_fields():
    for overrides in (
        ["--config.task.name=parallel_text", "--config.task.train=x.tsv"],
        ["--config.task.train=x.tsv", "--config.task.name=parallel_text"],
    ):
        config = base.load("configs/default.py", overrides)
        assert (config.task.name, config.task.train) == ("parallel_text", "x.tsv") and "train_size" not in config.task
    config = base.load("configs/default.py", ["--config.model.hidden_dim=32", "--config.model.name=rnnsearch"])
    assert (config.model.name, config.model.hidden_dim, config.model.attention_dim) == ("rnnsearch", 32, 1000)
    with pytest.raises(ConfigError, match=r"unknown config field 'task.trian'; valid in task: dev, .*train\b"):
        base.load("configs/default.py", ["--config.task.name=parallel_text", "--config.task.trian=x.tsv"])


# ---------------------------------------------------------------- checks before anything runs


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"model.share_embeddings": True, "tokenizer.shared": False},
            "model.share_embeddings=True .* tokenizer.shared=False",
        ),
        (
            {"model.positional": "learned", "model.max_length": 40},
            r"data.max_source_length = 48 is longer than model.max_length = 40",
        ),
        (
            {"model.positional": "learned", "model.max_length": 60},
            r"max_source_length \+ decode.max_length_offset = 98 is longer than model.max_length = 60",
        ),
        ({"decode.num_hypotheses": 3}, "decode.num_hypotheses must be between 1 and decode.beam_size"),
        ({"metrics.bleu_tokenize": "ja-mecab"}, "metrics.bleu_tokenize must be one of"),
        ({"model.d_model": 0}, "model.d_model must be positive"),
        ({"model": base.model("lstmn", fusion="medium")}, "model.fusion must be one of shallow, deep"),
        (
            {"model": base.model("lstmn", max_length=40)},
            "data.max_source_length = 48 is longer than model.max_length = 40",
        ),
        (
            {"model": base.model("lstmn", max_length=600), "batch_size": 4096, "data.max_source_length": 512},
            "the LSTMN tapes of 4096 rows of up to 512 tokens need about",
        ),
    ],
)
def test_settings_that_cannot_work_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        preflight.check(parse(tiny_config("unused", **overrides)), make_mesh(jax.devices()[:1]))


# ---------------------------------------------------------------- the Python API


def test_a_run_folder_from_before_a_field_existed_resumes_and_loads(finished_run, tmp_path):
    config, workdir, _ = finished_run
    run = copy_of(workdir, tmp_path)
    saved = json.loads((run / "config.json").read_text())
    # a field added after the run was made
    del saved["data"]["batch_tokens"]
    (run / "config.json").write_text(json.dumps(saved))
    # the same run: no refusal over the missing field
    compatibility.check_resume(parse(config), run)
    assert inference.load(run).translate(["3 March 2021"])


def test_a_resumed_run_keeps_its_dropout_masks_and_attention_biases_whatever_the_command_says(finished_run, tmp_path):
    """`dropout_masks` and `use_bias` are `KEPT_ON_RESUME`: the run's value wins over the command's,
    on resume and in evaluation (either way; a run from before the field reads back as "bernoulli";
    a Transformer run from before 2026-11-28 has attention biases, today's default has none), and
    another model field still stops the run."""
    config, workdir, _ = finished_run
    run = copy_of(workdir, tmp_path)
    saved = json.loads((run / "config.json").read_text())
    assert (saved["model"]["dropout_masks"], saved["model"]["use_bias"]) == ("packed", False)
    command = locked_with(
        config.copy_and_resolve_references(), {"model.dropout_masks": "bernoulli", "model.use_bias": True}
    )
    resumed = compatibility.check_resume(parse(command), run).model.hyperparameters
    assert (resumed.dropout_masks, resumed.use_bias) == ("packed", False)
    evaluated = compatibility.for_evaluation(parse(saved), parse(command), []).model.hyperparameters
    assert (evaluated.dropout_masks, evaluated.use_bias) == ("packed", False)
    # the benchmarks that build a run's model from their own config (kjv_comparison, length_experiment)
    rebuilt = compatibility.as_the_run_began(parse(command), run).model.hyperparameters
    assert (rebuilt.dropout_masks, rebuilt.use_bias) == ("packed", False)
    assert compatibility.as_the_run_began(parse(command), tmp_path / "no_run").model.hyperparameters.use_bias
    # a config.json without the fields: the values of the runs made before (`fields_before`)
    del saved["model"]["dropout_masks"], saved["model"]["use_bias"]
    (run / "config.json").write_text(json.dumps(saved))
    resumed = compatibility.check_resume(parse(config), run).model.hyperparameters
    assert (resumed.dropout_masks, resumed.use_bias) == ("bernoulli", True)
    changed = locked_with(config.copy_and_resolve_references(), {"model.dropout_rate": 0.3})
    with pytest.raises(ConfigError, match="holds a run with another config: model.dropout_rate"):
        compatibility.check_resume(parse(changed), run)


def test_inference_api_from_a_copied_run_folder(finished_run, tmp_path):
    _, workdir, _ = finished_run
    run = copy_of(workdir, tmp_path)
    saved = json.loads((run / "config.json").read_text())
    # inference needs no training data
    saved["data_dir"] = str(tmp_path / "no_data_here")
    (run / "config.json").write_text(json.dumps(saved))
    translator = inference.load(run)
    sources = ["3 March 2021", "12/24/99"]
    outputs = translator.translate(sources)
    assert len(outputs) == 2 and all(isinstance(o, str) for o in outputs)
    assert not (tmp_path / "no_data_here").exists()
    # decoded sorted by length, returned in order
    mixed = ["the 1st of January, 1999", "12/24/99", "3 March 2021"]
    assert translator.translate(mixed, beam_size=2) == [translator.translate([s], beam_size=2)[0] for s in mixed]
    # score: the summed log-probabilities of the targets' tokens, eos included, which greedy search
    # also returns for its own output
    # lp = 1: log P itself
    greedy = translator.n_best(sources, beam_size=1, length_penalty=0.0)
    np.testing.assert_allclose(translator.score(sources, outputs), [h[0][1] for h in greedy], rtol=1e-4, atol=1e-4)
    n_best = translator.n_best(sources, beam_size=3, num_hypotheses=3)
    assert all(len(h) == 3 and h[0][1] >= h[1][1] >= h[2][1] for h in n_best)
    samples = translator.translate(sources, method="sample", temperature=0.5)
    assert len(samples) == 2
    weights = translator.attention(sources[0])
    output_ids = translator.translate_ids([sources[0]])[0][0][0]
    cross = weights["decoder_layers/0/cross_attention"]
    assert cross.shape == (2, len(output_ids), len(translator.run.tokens.source.encode(sources[0])) + 1)
    np.testing.assert_allclose(cross.sum(-1), 1.0, rtol=1e-5)
    assert output_ids[-1] == EOS_ID
    with pytest.raises(ConfigError, match="unknown decode option"):
        translator.translate(sources, beem_size=2)


# ---------------------------------------------------------------- early stopping and BLEU's tokenizer


@pytest.mark.slow
def test_early_stopping_ends_the_run_and_its_count_survives_a_resume(shared_data_dir, tmp_path):
    # learning rate 0: the dev loss never improves after the first evaluation
    overrides = dict(
        learning_rate=0.0, schedule="constant", num_train_steps=40, eval_every_steps=5, checkpoint_every_steps=40
    )
    final = training_loop.train_and_evaluate(
        parse(tiny_config(shared_data_dir, early_stopping_patience=2, **overrides)), tmp_path
    )
    # best at 5, then 2 without
    assert [r["step"] for r in rows(tmp_path) if r["split"] == "dev"] == [5, 10, 15]
    assert [r["step"] for r in rows(tmp_path) if r["split"] == "test"] == [15] and "test" in final
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [15]
    # two more evaluations are allowed now only if the count started over: it must not
    training_loop.train_and_evaluate(
        parse(tiny_config(shared_data_dir, early_stopping_patience=3, **overrides)), tmp_path
    )
    assert [r["step"] for r in rows(tmp_path) if r["split"] == "dev"] == [5, 10, 15, 20]


def test_bleu_tokenizer_is_a_field_and_its_signature_is_kept():
    hypotheses, references = ["猫が座った。"], ["猫が座った"]
    default = score_registry.text_scores("bleu", hypotheses, references)
    by_char = score_registry.text_scores("bleu", hypotheses, references, bleu_tokenize="char")
    assert "tok:13a" in default["bleu_signature"] and "tok:char" in by_char["bleu_signature"]
    # 13a sees one word; char sees the shared characters
    assert by_char["bleu"] > default["bleu"]


def test_the_evaluation_loss_runs_in_the_train_steps_microbatches_with_the_same_sums_and_less_memory(
    shared_data_dir, tmp_path
):
    """With `grad_accum_steps`, the dev loss is summed over the train step's microbatches, one after
    another: the same sums as the whole batch's at once (the reference: the model on the whole batch),
    in a smaller XLA buffer (the logits of a microbatch at a time)."""
    from run_setup.run import prepare_run
    from scoring import metrics

    config = tiny_config(shared_data_dir, batch_size=64, grad_accum_steps=4)
    run = prepare_run(parse(config), tmp_path / "run", devices=jax.devices()[:1], training=False)
    evaluator = evaluation.Evaluator(run)
    batch = next(evaluator.batches("dev"))[0]
    whole = jax.jit(
        lambda params, batch: metrics.token_sums(run.model(params)(batch, deterministic=True), batch["targets"])
    )
    chunked, reference = evaluator.loss_sums(run.params, batch), whole(run.params, batch)
    assert chunked.keys() == reference.keys()
    for name in reference:
        np.testing.assert_allclose(chunked[name], reference[name], rtol=1e-6, err_msg=name)
    buffers = [
        function.lower(run.params, batch).compile().memory_analysis().temp_size_in_bytes
        for function in (evaluator.loss_sums, whole)
    ]
    print(f"the evaluation loss's XLA buffer: {buffers[0]:,} bytes in 4 microbatches, {buffers[1]:,} at once")
    assert buffers[0] < buffers[1]
    run.checkpoints.close()


# ---------------------------------------------------------------- fine-tuning


def test_a_run_initialised_from_another_starts_at_its_dev_loss_and_loads_like_any_other(finished_run, tmp_path):
    from run_setup.run import prepare_run

    config, workdir, final = finished_run
    tuned = tiny_config(
        config.data_dir,
        init_from=f"{workdir}:20",
        num_train_steps=2,
        eval_every_steps=2,
        checkpoint_every_steps=2,
        # a field that shapes no parameter may change
        **{"model.dropout_rate": 0.0},
    )
    # before its first update
    run = prepare_run(parse(tuned), tmp_path / "first")
    results, _ = evaluation.evaluate_split(evaluation.Evaluator(run), run.params, "dev", max_decoded=1)
    # the other run's parameters, exactly
    assert results["loss"] == final["dev"]["loss"]
    assert (tmp_path / "first" / "tokenizer" / "shared.json").read_bytes() == (
        workdir / "tokenizer" / "shared.json"
    ).read_bytes()
    run.checkpoints.close()
    training_loop.train_and_evaluate(parse(tuned), tmp_path / "tuned")
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["init_from"] == f"{workdir}:20"
    assert inference.load(tmp_path / "tuned").translate(["3 March 2021"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.d_ff": 64}, r"its parameters do not fit this model \(model.d_ff: 32 -> 64\)"),
        (
            {"tokenizer.max_corpus_chars": 5000},
            r"its vocabulary was made with other settings: tokenizer.max_corpus_chars: 10000000 -> 5000",
        ),
    ],
)
def test_a_run_to_start_from_that_does_not_fit_is_refused_naming_the_fields(finished_run, tmp_path, overrides, message):
    config, workdir, _ = finished_run
    with pytest.raises(ConfigError, match=message):
        training_loop.train_and_evaluate(
            parse(tiny_config(config.data_dir, init_from=str(workdir), **overrides)), tmp_path / "new"
        )
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="init_from .* is not a run folder"):
        training_loop.train_and_evaluate(parse(tiny_config(config.data_dir, init_from=str(tmp_path))), tmp_path / "new")
