"""``graphmode conformance``: run the suite for one vendor, or for every
installed vendor on the CPU emulator, and print a summary table.

Sizes come from the vendor's declarations, then from the size flags
(``--block-size``, ``--max-batches``, ``--capture-sizes``, ``--dtype``,
``--table-width``); each run's header says what was used. On ``--device
cuda`` the runs set ``GRAPHMODE_CHECK_HOST_READS=1`` (unless set), so that a
host read on the replay path fails there too.

Each vendor runs in its own pytest process, so one vendor's failure (or
crash) cannot hide another's result (``graphmode_conformance.processes``:
on the CPU emulator forked from a server that imported torch once). Exit
status: 0 when every run passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from graphmode.checks.host_reads import ENV_CHECK_HOST_READS
from graphmode.errors import ConfigError, GraphModeError
from graphmode.plugins import BUILTIN_VENDOR, installed_vendor_names, select_vendor
from graphmode_conformance.plugin import Target, describe, pick_variant, resolve_target
from graphmode_conformance.processes import run_pytest
from graphmode_conformance.sizes import DTYPES, Sizes, parse_capture_sizes

SUITE = Path(__file__).with_name("test_conformance.py")
# pytest's exit status when no test was collected (pytest.ExitCode.NO_TESTS_COLLECTED).
NO_TESTS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vendor", help="vendor to test (default: detected; every vendor on a machine without accelerator)")
    parser.add_argument("--device", help="device graphs run on; cpu is the graph emulator")
    parser.add_argument("--xfails", help="file of test ids expected to fail (# comments)")
    parser.add_argument("--report", help="write a JSON report (one record per test) here")
    parser.add_argument("-k", dest="keyword", help="only tests matching this pytest expression")
    parser.add_argument("--variant", metavar="ID",
                        help="only this one of the vendor's option variants, as the test ids name it "
                             "(--vendor ascend --variant update_path=task_group); tests without options run as always")
    parser.add_argument("--plugin", metavar="MODULE:OBJECT",
                        help="test this plugin object (a plugin in development, not installed) instead of an entry point")
    sizes = parser.add_argument_group("sizes (default: the vendor's declarations, then the suite's defaults)")
    sizes.add_argument("--block-size", type=int, help="KV-cache block size (default: the vendor's first declared, else 16)")
    sizes.add_argument("--max-batches", type=int, help="the runner's max_batches (default 48)")
    sizes.add_argument("--capture-sizes", metavar="1,3,6", help="a user capture list (default: the vendor's policy)")
    sizes.add_argument("--dtype", choices=sorted(DTYPES), help="model dtype (default float32)")
    sizes.add_argument("--table-width", type=int, help="block-table buffer width in blocks (default 8)")
    parser.add_argument("pytest_args", nargs="*", help="further pytest arguments, after --")


def given_sizes(args: argparse.Namespace) -> Sizes:
    """The sizes the flags give, checked (every flag left out: the default)."""
    given: dict = {}
    if args.block_size is not None:
        given["block_size"] = args.block_size
    if args.max_batches is not None:
        given["max_batches"] = args.max_batches
    if args.table_width is not None:
        given["table_width"] = args.table_width
    if args.capture_sizes:
        given["capture_sizes"] = parse_capture_sizes(args.capture_sizes)
    if args.dtype:
        given["dtype"] = DTYPES[args.dtype]
    return Sizes(**given)


def size_options(args: argparse.Namespace) -> list[str]:
    """The size flags as the pytest plugin's options."""
    pairs = [
        ("--graphmode-block-size", args.block_size), ("--graphmode-max-batches", args.max_batches),
        ("--graphmode-table-width", args.table_width), ("--graphmode-capture-sizes", args.capture_sizes),
        ("--graphmode-dtype", args.dtype),
    ]
    return [part for option, value in pairs if value is not None for part in (option, str(value))]


def plugin_path(plugin: str | None) -> str | None:
    """The directory the plugin object's top-level module was imported from
    (after :func:`resolve_target` imported it), for the pytest process to
    import it alike: a module beside one's tests, say."""
    if not plugin:
        return None
    name = plugin.partition(":")[0].split(".")[0]
    top = sys.modules.get(name)
    location = getattr(top, "__file__", None)
    if location is None:
        return None
    path = Path(location).resolve().parent
    return str(path.parent if Path(location).name == "__init__.py" else path)


def process_env(target: Target, plugin: str | None) -> dict[str, str]:
    """The environment of a vendor's pytest process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if target.device.type == "cpu":
        # The suite's model is tiny: a second thread per process only adds
        # contention (eight times slower on a loaded 2-core machine).
        env.setdefault("OMP_NUM_THREADS", "1")
    if target.device.type == "cuda":
        # The replay path may not read device values on the host: on CUDA the
        # runner checks that only when asked (graphmode.checks.host_reads).
        env.setdefault(ENV_CHECK_HOST_READS, "1")
    where = plugin_path(plugin)
    if where:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (where, env.get("PYTHONPATH")) if p)
    return env


def targets(vendor: str | None, device: str | None, plugin: str | None = None) -> list[tuple[str | None, str | None]]:
    """(vendor, device) pairs to run: the asked vendor (or plugin object), the
    detected one on its device, or every installed vendor on the emulator
    (asked with ``--device cpu``, or on a machine without accelerator)."""
    if vendor or plugin:
        return [(vendor, device)]
    if device == "cpu":
        return [(name, "cpu") for name in installed_vendor_names()]
    detected = select_vendor(None, device)
    accelerator = detected.name != BUILTIN_VENDOR or torch.cuda.is_available()
    if accelerator or device:
        return [(detected.name, device)]
    return [(name, "cpu") for name in installed_vendor_names()]


def run(args: argparse.Namespace) -> int:
    # Resolve every target here, once: a mistaken vendor or device is one
    # clear line, not the same error from every test of a pytest process.
    try:
        sizes = given_sizes(args)
        if args.xfails:
            check_xfails(Path(args.xfails))
        check_working_directory(Path.cwd())
        if args.plugin and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does: a plugin module here imports
        plan = targets(args.vendor, args.device, args.plugin)
        resolved = [resolve_target(vendor, device, args.plugin) for vendor, device in plan]
        for target in resolved:
            check_block_size(target, sizes)
            if args.variant:
                check_variant(target, args.variant)
    except GraphModeError as error:
        print(f"graphmode conformance: {error}", file=sys.stderr)
        return 2
    runs = []
    for index, ((vendor, device), target) in enumerate(zip(plan, resolved, strict=True), start=1):
        print(f"== vendor {index}/{len(plan)}: {target.vendor.name} on {target.device} ==", flush=True)
        for line in describe(target, sizes, args.variant):
            print(f"   {line}", flush=True)
        if device is None and target.device.type == "cpu" and not target.vendor.info.detected:
            info = target.vendor.info
            print(f"   device cpu: {info.name} is not detected here ({info.reason}), so its graphs run on the "
                  f"CPU graph emulator; on its hardware pass --device {info.device_types[0]}", flush=True)
        env = process_env(target, args.plugin)
        with tempfile.TemporaryDirectory() as scratch:
            report = Path(scratch) / "report.json"
            command = [
                str(SUITE), "-p", "graphmode_conformance.plugin",
                "-p", "no:cacheprovider", *_verbosity(args.pytest_args), "--rootdir", str(SUITE.parent),
                "--graphmode-report", str(report),
            ]
            if vendor:
                command += ["--graphmode-vendor", vendor]
            if device:
                command += ["--graphmode-device", device]
            if args.xfails:
                command += ["--graphmode-xfails", str(Path(args.xfails).resolve())]
            if args.plugin:
                command += ["--graphmode-plugin", args.plugin]
            command += size_options(args)
            if args.keyword:
                command += ["-k", args.keyword]
            if args.variant:
                command += ["--graphmode-variant", args.variant]
            command += args.pytest_args
            started = time.perf_counter()
            status = run_pytest(command, env, fork=target.device.type == "cpu")
            elapsed = time.perf_counter() - started
            data = json.loads(report.read_text()) if report.exists() else {"records": [], "device": device}
        data.update(vendor=data.get("vendor") or target.vendor.name, exit_status=status, seconds=round(elapsed, 1))
        runs.append(data)
    print_summary(runs)
    for run in runs:
        if run["exit_status"] == NO_TESTS:
            chosen = " and ".join(f"{flag} {value!r}" for flag, value in (("-k", args.keyword), ("--variant", args.variant))
                                  if value) or "the given arguments"
            print(f"graphmode conformance: no test of vendor {run['vendor']} matched {chosen}; "
                  "`-- --collect-only -q` lists the test ids", file=sys.stderr)
    if args.report:
        Path(args.report).write_text(json.dumps({"runs": runs}, indent=1))
    return 0 if runs and all(r["exit_status"] == 0 for r in runs) else 1


def print_summary(runs: list[dict]) -> None:
    outcomes = ("passed", "failed", "xfailed", "xpassed", "skipped")
    print("\n== graphmode conformance summary ==")
    header = f"{'vendor':16s} {'device':8s} " + " ".join(f"{o:>8s}" for o in outcomes) + f" {'time':>7s}  result"
    print(header)
    for run in runs:
        counts = {o: sum(r["outcome"] == o for r in run["records"]) for o in outcomes}
        counts["failed"] += sum(r["outcome"] == "error" for r in run["records"])
        status = run["exit_status"]
        result = "PASS" if status == 0 else "NO TEST MATCHED" if status == NO_TESTS else f"FAIL (exit {status})"
        print(f"{run['vendor']:16s} {str(run.get('device')):8s} " + " ".join(f"{counts[o]:8d}" for o in outcomes)
              + f" {run['seconds']:6.1f}s  {result}")


def check_xfails(path: Path) -> None:
    """Refuse an ``--xfails`` file that is not there (each vendor's pytest
    process would stop in an INTERNALERROR traceback)."""
    if not path.is_file():
        raise ConfigError(f"--xfails {path}: no such file (a file of test ids expected to fail, one per line, "
                          "'#' comments; docs/conformance.md)")


def check_block_size(target: Target, sizes: Sizes) -> None:
    """Refuse a ``--block-size`` the vendor does not take (``GraphSpec.block_sizes``)
    before any test runs: every test would fail on it, each with the runner's error."""
    declared, given = target.vendor.spec.block_sizes, sizes.block_size
    if declared is not None and given is not None and given not in declared:
        raise ConfigError(
            f"--block-size {given}: vendor {target.vendor.name!r} takes KV-cache blocks of "
            f"{' or '.join(map(str, declared))} tokens (GraphSpec.block_sizes); pass --block-size {declared[0]}, "
            "or leave it out for the vendor's first declared size"
        )


def check_variant(target: Target, wanted: str) -> None:
    """Refuse ``--variant wanted`` unless the vendor declares that variant."""
    try:
        pick_variant(target.vendor.spec.option_variants, wanted)
    except pytest.UsageError as error:
        raise ConfigError(f"--variant: vendor {target.vendor.name}: {error}") from None


#: What every suite process imports, which a folder or module of the same name in the working directory
#: (on sys.path in each, as `python -m pytest` puts it there) would replace.
SUITE_PACKAGES = ("graphmode", "graphmode_conformance", "pytest", "pluggy", "torch")


def check_working_directory(cwd: Path) -> None:
    """Refuse to run from a directory holding a folder or module named as a
    package the suite imports, other than that package itself: each suite
    process has the working directory first on sys.path, so ``import
    graphmode`` would find the folder (a clone's, say: a namespace package
    with no ``hookimpl``) instead of the installed package."""
    for name in SUITE_PACKAGES:
        here = [path for path in (cwd / name, cwd / f"{name}.py") if path.exists()]
        if not here:
            continue
        spec = importlib.util.find_spec(name)
        installed = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if installed is None or not installed.is_relative_to(here[0].resolve()):
            raise ConfigError(
                f"the working directory {cwd} holds {here[0].name!r}, which each suite process would import as "
                f"{name} (it runs with the working directory first on sys.path, as `python -m pytest` does) instead "
                f"of the installed {name}{f' ({installed})' if installed else ''}. Run graphmode conformance from "
                "another directory (your plugin's, for instance)"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphmode conformance", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _verbosity(pytest_args: list[str]) -> list[str]:
    """Quiet by default; a verbosity flag after ``--`` (``-v``, ``-vv``,
    ``--verbose``, ``-q``) replaces it rather than cancelling against it."""
    chosen = any(arg.startswith(("-v", "-q", "--verbose", "--quiet")) for arg in pytest_args)
    return [] if chosen else ["-q"]
