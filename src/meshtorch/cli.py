"""The ``meshtorch`` command line: one sub-command per module that owns it.

Each sub-command lives next to the code it drives and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable
taking the parsed ``argparse.Namespace`` and returning an exit code.

Example:
    $ meshtorch --help
"""

from __future__ import annotations

import argparse
import importlib
import sys

from meshtorch.errors import MeshTorchError

# module path of each sub-command, in the order `--help` lists them
SUBCOMMANDS: tuple[str, ...] = (
    "meshtorch.launch.cli",
    "meshtorch.train_cli",
    "meshtorch.placement.cli",
    "meshtorch.plan.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every registered sub-command."""
    parser = argparse.ArgumentParser(prog="meshtorch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshtorch`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except MeshTorchError as e:
        print(f"meshtorch {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
