"""``graphmode``: conformance, vendors, bench.

    graphmode conformance [--vendor NAME] [--device DEV] [--variant ID] [--xfails FILE] [--report FILE.json] [-k EXPR]
    graphmode vendors [--max-batches N]
    graphmode bench [--device cuda] [--json FILE] [--plot FILE.png] ...
    graphmode bench --workload prefill|offload [--cases 1x128,mix512+64,...] [--json FILE] ...
    graphmode --version | --help

``--help`` and ``--version`` import no torch. Every command needs torch,
which is imported once the command is known: when that fails (an
auto-loaded device backend missing its libraries), the command prints advice
and exits 1 instead of a traceback. Each command's own arguments are parsed
by its own parser (``graphmode bench --help``), built after torch imported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import graphmode
from graphmode.cli.advice import torch_import_failure

# Each command and its one-line help; the order of `graphmode --help`.
COMMANDS = {
    "conformance": "prove a vendor's graphs equal eager (the conformance suite)",
    "vendors": "list installed vendors and why each is usable",
    "bench": "measure graph mode against eager and the alternatives",
}


def top_parser() -> argparse.ArgumentParser:
    """The parser of ``graphmode`` itself: the command, and everything after
    it left to the command's own parser."""
    listing = "\n".join(f"  {name:13s} {text}" for name, text in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="graphmode", description="Graph mode for LLM decode steps on every accelerator.",
        epilog=f"commands:\n{listing}\n\n`graphmode COMMAND --help` lists a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"graphmode {graphmode.__version__}")
    parser.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND",
                        help=f"one of {', '.join(COMMANDS)}")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = top_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    failure = torch_import_failure()
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    command = argparse.ArgumentParser(prog=f"graphmode {args.command}", description=COMMANDS[args.command])
    run = _command(args.command, command)
    if run is None:
        print("graphmode conformance: the conformance suite runs on pytest, which is not installed: "
              "pip install 'graphmode[conformance]'", file=sys.stderr)
        return 2
    return run(command.parse_args(args.arguments))


def _command(name: str, parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int] | None:
    """Add command ``name``'s arguments to ``parser``; its run function, or
    None for the conformance suite without pytest."""
    if name == "conformance":
        try:
            from graphmode_conformance import cli as conformance
        except ModuleNotFoundError as error:
            if error.name != "pytest":
                raise
            return None
        conformance.add_arguments(parser)
        return conformance.run
    if name == "vendors":
        from graphmode.cli import vendors

        vendors.add_arguments(parser)
        return vendors.run
    from graphmode.bench import cli as bench
    from graphmode.bench.common import add_arguments as bench_arguments

    bench_arguments(parser)
    return bench.run


if __name__ == "__main__":
    sys.exit(main())
