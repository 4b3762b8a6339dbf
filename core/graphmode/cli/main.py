"""``graphmode``: conformance, vendors, bench.

    graphmode conformance [--vendor NAME] [--device DEV] [--xfails FILE] [--report FILE.json] [-k EXPR]
    graphmode vendors [--max-batches N]
    graphmode bench [--device cuda] [--json FILE] [--plot FILE.png] ...
    graphmode bench --workload prefill|offload [--cases 1x128,mix512+64,...] [--json FILE] ...

Every command needs torch, which is imported here first, inside ``main``: when
it fails (an auto-loaded device backend missing its libraries), the command
prints advice and exits 1 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from graphmode.cli.advice import torch_import_failure


def main(argv: list[str] | None = None) -> int:
    failure = torch_import_failure()
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog="graphmode", description="graph mode for LLM decode steps")
    commands = parser.add_subparsers(dest="command", required=True)

    conformance_parser = commands.add_parser("conformance", help="prove a vendor's graphs equal eager")
    conformance: ModuleType | None
    try:
        from graphmode_conformance import cli as conformance_cli
    except ModuleNotFoundError as error:
        if error.name != "pytest":
            raise
        conformance = None
        conformance_parser.add_argument("arguments", nargs=argparse.REMAINDER)
    else:
        conformance = conformance_cli
        conformance.add_arguments(conformance_parser)

    from graphmode.cli import vendors

    vendors.add_arguments(commands.add_parser("vendors", help="list installed vendors and why each is usable"))

    from graphmode.bench import cli as bench
    from graphmode.bench.common import add_arguments as bench_arguments

    bench_arguments(commands.add_parser("bench", help="measure graph mode against eager and the alternatives"))

    args = parser.parse_args(argv)
    if args.command == "conformance":
        if conformance is None:
            parser.error("the conformance suite runs on pytest: pip install 'graphmode[conformance]'")
        return conformance.run(args)
    if args.command == "vendors":
        return vendors.run(args)
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
