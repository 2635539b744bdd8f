"""The ``meshtorch`` command line.

Each sub-command lives next to the code it drives and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable
taking the parsed ``argparse.Namespace`` and returning an exit code.

Example:
    >>> from meshtorch.cli import main
    >>> main(["train", "--model", "gpt"])
    2
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys

from meshtorch.errors import MeshTorchError
from meshtorch.streams import reader_may_leave

# module that registers each sub-command, in the order `--help` lists them
SUBCOMMANDS: dict[str, str] = {
    "launch": "meshtorch.launcher.cli",
    "train": "meshtorch.recipes.lm.cli",
    "generate": "meshtorch.recipes.lm.cli",
    "export": "meshtorch.recipes.lm.cli",
    "plan": "meshtorch.recipes.lm.cli",
    "place": "meshtorch.placement.cli",
}
DESCRIPTION = ("meshtorch: named tensor dimensions split over a processor mesh. Train, plan and place "
               "models on a mesh of processors; 'meshtorch COMMAND --help' describes each command.")


class CommandParser(argparse.ArgumentParser):
    """The top-level parser: an argument that no parser takes is reported by the sub-command's parser
    (argparse's own reports it at the top level, with ``meshtorch [-h] COMMAND ...`` as the usage),
    naming the option it is close to (argparse's ``suggest_on_error`` needs Python 3.14, and covers
    choices only).

    Example:
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        ...     build_parser("place").parse_args(["place", "graph.json", "--devics", "2"])
        >>> err.getvalue().splitlines()[-1]
        'meshtorch place: error: unrecognized arguments: --devics 2 (did you mean --devices?)'
    """

    commands: argparse._SubParsersAction | None = None

    def parse_args(self, args=None, namespace=None):
        known, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(known, "command", None)
            parser = self.commands.choices[command] if self.commands and command else self
            others = {name: other for name, other in _every_command(self).items() if name != command}
            parser.error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(parser, extras, others)}")
        return known


class SubcommandParser(argparse.ArgumentParser):
    """A sub-command's parser: when a required option is missing because it was mistyped
    (``meshtorch export --checkpont run/ --out x``), the error names the typo beside the missing
    option; argparse stops at the missing one and never reports the argument it did not take.

    Example:
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        ...     build_parser("export").parse_args(["export", "--checkpont", "run", "--out", "x"])
        >>> err.getvalue().splitlines()[-1].partition("required: ")[2]
        '--checkpoint; unrecognized arguments: --checkpont (did you mean --checkpoint?)'
    """

    _given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message):
        missing = message.partition("the following arguments are required: ")[2]
        if missing:
            wanted = [m for m in missing.split(", ") if m.startswith("--")]
            options = _long_options(self)
            close = [f"{typed} (did you mean {match}?)" for typed in _typed_options(self._given)
                     if not any(o.startswith(typed) for o in options)  # argparse takes a prefix
                     for match in [_close_option(typed, wanted)] if match]
            if close:
                message += f"; unrecognized arguments: {', '.join(close)}"
        super().error(message)


# how alike a typo and an option must be (difflib's ratio) to be suggested: typos score 0.78 and more
# (--batchsize/--batch, --layred/--layered), unrelated options of shared letters 0.67 (--search/--batch)
CLOSE = 0.75


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    """The ``--`` options ``parser`` takes, ``--help`` included.

    argparse has no public list of its options: its private table (``_option_string_actions``,
    Python 3.10 to 3.14) is read, and without it the option strings that its help lists.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> _ = p.add_argument("-b", "--batch", type=int)
        >>> _ = p.add_argument("--relay", action=argparse.BooleanOptionalAction)
        >>> _long_options(p)
        ['--help', '--batch', '--relay', '--no-relay']
    """
    table = getattr(parser, "_option_string_actions", None)
    if isinstance(table, dict):
        return [o for o in table if o.startswith("--")]
    # without it, the option strings that begin each action's line in the help, up to two spaces or the
    # line's end ("  -b BATCH, --batch BATCH  the batch ..."); wrapped help text is indented further
    invocations = re.findall(r"^ {1,8}(-\S.*?)(?:  |$)", parser.format_help(), flags=re.MULTILINE)
    return list(dict.fromkeys(option for line in invocations
                              for option in re.findall(r"(?:^|, )(--[\w-]+)(?=[ ,]|$)", line)))


def _typed_options(args: list[str]) -> list[str]:
    """The ``--`` options among a command line's arguments, once each, without a ``=value``."""
    return list(dict.fromkeys(a.partition("=")[0] for a in args if a.startswith("--")))


def _close_option(typed: str, options: list[str]) -> str | None:
    """The option among ``options`` that ``typed`` reads as a typo of (difflib's ratio of at least
    ``CLOSE``), or None.

    Example:
        >>> _close_option("--batchsize", ["--batch", "--layers"]), _close_option("--search", ["--batch"])
        ('--batch', None)
    """
    match = difflib.get_close_matches(typed, options, n=1, cutoff=CLOSE)
    return match[0] if match else None


def _did_you_mean(parser: argparse.ArgumentParser, extras: list[str],
                  others: dict[str, argparse.ArgumentParser] | None = None) -> str:
    """`` (did you mean --batch?)`` for the options among ``extras`` close to one of ``parser``'s;
    an option of another sub-command among ``others`` (``meshtorch train --search``) is named as
    that command's."""
    close, elsewhere = [], []
    for typed in _typed_options(extras):
        owners = [name for name, other in (others or {}).items() if typed in _long_options(other)]
        if owners:
            elsewhere.append(f"{typed} is an option of meshtorch {' and '.join(owners)}")
        elif match := _close_option(typed, _long_options(parser)):
            close.append(match)
    hints = ([f"did you mean {', '.join(close)}?"] if close else []) + elsewhere
    return f" ({'; '.join(hints)})" if hints else ""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: every sub-command, or only ``command``'s when given.

    Registering only the command being run keeps ``meshtorch place graph.json``
    free of torch (its module needs numpy and scipy only).

    Example:
        >>> build_parser("place").parse_args(["place", "graph.json", "--devices", "2"]).devices
        2
    """
    parser = CommandParser(prog="meshtorch", description=DESCRIPTION)
    sub = parser.commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                                  parser_class=SubcommandParser)
    modules = [SUBCOMMANDS[command]] if command in SUBCOMMANDS else SUBCOMMANDS.values()
    for module in dict.fromkeys(modules):
        importlib.import_module(module).register(sub)
    return parser


def _every_command(parser: CommandParser) -> dict[str, argparse.ArgumentParser]:
    """Every sub-command's parser, by name: ``parser``'s own, and those ``build_parser`` left out (it
    registers only the command being run) built now, so that an error names another command's
    option (``meshtorch place --hardware l4``: an option of plan) whichever command was run. Only an
    error comes here, where the import time (torch's, ~2 s) does not matter; a module that cannot be
    imported gives no sub-command."""
    commands = dict(parser.commands.choices) if parser.commands else {}
    missing = [module for name, module in SUBCOMMANDS.items() if name not in commands]
    sub = argparse.ArgumentParser().add_subparsers(parser_class=SubcommandParser)
    for module in dict.fromkeys(missing):
        try:
            importlib.import_module(module).register(sub)
        except ImportError:
            pass
    return {**commands, **sub.choices}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshtorch`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a flag argparse rejected (it printed why)
        return e.code if isinstance(e.code, int) else 2
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    with reader_may_leave():  # `meshtorch train ... | head`: the run goes on when the reader leaves
        try:
            return int(args.func(args) or 0)
        except MeshTorchError as e:
            print(f"meshtorch {args.command}: error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
