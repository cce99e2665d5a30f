"""Inference from a run folder, in Python or from the command line.

    translator = inference.load("runs/X")                 # latest checkpoint; or step=N, best=True, average_last=K
    translator.translate(["3rd of March, 2021"], beam_size=4)      # -> ["2021-03-03"]
    translator.score(["3rd of March, 2021"], ["2021-03-03"])       # -> summed log-probabilities, eos included
    translator.attention("3rd of March, 2021")                     # -> {module: weights [N, T, S]}
    captioner.translate(images)                # a captioning run: images [H, W] or [H, W, C] uint8 -> captions

    python inference.py --workdir=runs/X --text "3rd of March, 2021" [--self_attention]
    # in place of --text: --image FILE or --features FILE.npy

`load` restores: it reads only the run folder (`config.json`, the vocabulary in
`tokenizer/` and the parameters of a checkpoint; no optimizer state, no training
data), so a run folder copied to another machine decodes. The `Translator` it
returns searches and scores (engine/restored_model.py). The command prints the output and
draws its attention into `WORKDIR/attention/<kind>/` (text, image, features).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import jax
from absl import flags

from engine.restored_model import Translator
from run_setup import command_line
from run_setup.input_kinds import KINDS
from run_setup.run import prepare_run
from run_setup.settings import Settings, read_run_settings, single_process
from utils import metric_writer
from utils.errors import DataError, UserError


def load(
    workdir: str | Path,
    *,
    step: int | None = None,
    best: bool = False,
    average_last: int = 0,
    settings: Settings | None = None,
) -> Translator:
    """A `Translator` of the run in `workdir`: checkpoint `step`, the best, or the latest; with
    `average_last=K > 1`, the mean parameters of the last K checkpoints up to that one.

    `settings` replace `workdir/config.json`'s (predict passes its own, with its decode settings).
    """
    if settings is None:
        settings = read_run_settings(workdir)
        if settings is None:
            raise DataError(f"{workdir} holds no config.json: not a run folder")
    run = prepare_run(
        single_process(settings), workdir, devices=jax.local_devices()[:1], with_data=False, training=False
    )
    restored_step, params = run.restore_params(step, best=best)
    if average_last > 1:
        _, params = run.averaged_params(average_last, restored_step)
    run.checkpoints.close()
    return Translator(run, restored_step, params)


def translate_file(settings: Settings, workdir: str | Path, input_file: str) -> Path:
    """`train.py --mode=predict --input_file=FILE` (`-`: standard input): one source per line into
    `predictions/step_<N>_<name>.tsv` (source, empty reference, hypothesis). Blank lines are skipped."""
    text = sys.stdin.read() if input_file == "-" else _read_text(input_file)
    sources = [line.strip() for line in text.splitlines() if line.strip()]
    if not sources:
        raise DataError(f"--input_file {input_file} holds no source line")
    checkpoints = settings.checkpoints
    translator = load(
        workdir,
        step=checkpoints.step_to_restore,
        best=checkpoints.restore_best,
        average_last=checkpoints.average_last,
        settings=settings,
    )
    hypotheses = translator.translate(sources)
    name = "stdin" if input_file == "-" else Path(input_file).stem
    path = Path(workdir) / "predictions" / f"step_{translator.step}_{name}.tsv"
    metric_writer.write_predictions(path, [(source, "", hypothesis) for source, hypothesis in zip(sources, hypotheses)])
    return path


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"--input_file {path} cannot be read: {error}") from error


# the command's own (train.py imports this module and has a --workdir of its own)
FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", None, "a run folder", required=True, flag_values=FLAGS)
# a flag per input kind, named by it: --text, --image, --features
for _kind in KINDS.values():
    flags.DEFINE_string(
        _kind.name,
        None,
        f"the source of a run on {_kind.name} inputs: {_kind.from_command_line.__doc__.splitlines()[0]}",
        flag_values=FLAGS,
    )
flags.DEFINE_integer("step", None, "the checkpoint (default: the latest)", flag_values=FLAGS)
flags.DEFINE_bool("self_attention", False, "draw self-attention too", flag_values=FLAGS)
flags.mark_flags_as_mutual_exclusive(list(KINDS), required=True, flag_values=FLAGS)


def main(argv: Sequence[str]) -> int:
    """The command: `argv` are its flags (the program's name left out)."""
    command_line.parse(FLAGS, ["inference.py", *argv], __doc__)
    given = next(FLAGS[name].value for name in KINDS if FLAGS[name].value is not None)
    try:
        translator = load(FLAGS.workdir, step=FLAGS.step)
        source = translator.kind.from_command_line(
            given, translator.settings.task.params, translator.settings.model.fields
        )
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    directory = Path(FLAGS.workdir) / "attention" / translator.kind.name
    output = translator.draw_attention(source, directory, self_attention=FLAGS.self_attention)
    print(f"{given!r} -> {output!r}")
    print(f"pictures and weights: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
