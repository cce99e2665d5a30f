"""One command-line syntax, absl's, for every script: `--name=value` (or `--name value`),
`--flagfile=FILE` (flags one a line, also `--config.*` overrides), and where a script takes a config,
`--config.a.b=value` overrides.

train.py parses absl's global flags (`app.run`); inference.py and the benchmarks, which other code
imports, keep their flags in a `flags.FlagValues` of their own, so that their names (`--workdir`,
...) never clash with train.py's, and parse them with `parse`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

HELP = ("--help", "-h", "--helpfull")


def split_overrides(argv: Sequence[str], flag_values: flags.FlagValues) -> tuple[list[str], list[str]]:
    """`(absl's arguments, the --config.a.b=value overrides)` of a command line `argv` (program
    first), in order, after expanding every `--flagfile=FILE` (absl would otherwise see a file's
    overrides, which are no flags of its own, and stop on the first)."""
    expanded = flag_values.read_flags_from_files(list(argv[1:]), force_gnu=False)
    overrides = [arg for arg in expanded if arg.startswith("--config.")]
    return [argv[0], *(arg for arg in expanded if not arg.startswith("--config."))], overrides


def parse(flag_values: flags.FlagValues, argv: Sequence[str], doc: str, *, overrides: bool = False) -> list[str]:
    """Parses `argv` (program first) into `flag_values`; returns the `--config.*` overrides (with
    `overrides`; otherwise they are refused like any unknown flag). `--help` prints `doc` and the
    flags, exit code 0; a wrong flag is one line on stderr, exit code 2 (as argparse did)."""
    program = argv[0].rsplit("/", 1)[-1]
    if any(arg in HELP for arg in argv[1:]):
        print(f"{doc.rstrip()}\n\nflags:\n{flag_values.get_help()}")
        sys.exit(0)
    # the defaults again (a second call in one process, e.g. from a test)
    flag_values.unparse_flags()
    try:
        arguments, found = split_overrides(argv, flag_values) if overrides else (list(argv), [])
        rest = flag_values(arguments)
        if len(rest) > 1:
            raise flags.Error(f"unexpected arguments: {' '.join(rest[1:])}")
        flag_values.validate_all_flags()
    except flags.Error as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        sys.exit(2)
    return found
