"""``graphmode conformance``: run the suite for one vendor, or for every
installed vendor on the CPU emulator, and print a summary table.

Each vendor runs in its own pytest process, so one vendor's failure (or
crash) cannot hide another's result. Exit status: 0 when every run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from graphmode.errors import GraphModeError
from graphmode.plugins import BUILTIN_VENDOR, installed_vendor_names, select_vendor
from graphmode_conformance.plugin import describe, resolve_target

SUITE = Path(__file__).with_name("test_conformance.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vendor", help="vendor to test (default: detected; every vendor on a machine without accelerator)")
    parser.add_argument("--device", help="device graphs run on; cpu is the graph emulator")
    parser.add_argument("--xfails", help="file of test ids expected to fail (# comments)")
    parser.add_argument("--report", help="write a JSON report (one record per test) here")
    parser.add_argument("-k", dest="keyword", help="only tests matching this pytest expression")
    parser.add_argument("--plugin", metavar="MODULE:OBJECT",
                        help="test this plugin object (a plugin in development, not installed) instead of an entry point")
    parser.add_argument("pytest_args", nargs="*", help="further pytest arguments, after --")


def targets(vendor: str | None, device: str | None, plugin: str | None = None) -> list[tuple[str | None, str | None]]:
    """(vendor, device) pairs to run: the asked vendor (or plugin object), the
    detected one on its device, or every installed vendor on the emulator."""
    if vendor or plugin:
        return [(vendor, device)]
    detected = select_vendor(None, device)
    accelerator = detected.name != BUILTIN_VENDOR or torch.cuda.is_available()
    if accelerator or (device and device != "cpu"):
        return [(detected.name, device)]
    return [(name, "cpu") for name in installed_vendor_names()]


def run(args: argparse.Namespace) -> int:
    # Resolve every target here, once: a mistaken vendor or device is one
    # clear line, not the same error from every test of a pytest process.
    try:
        plan = targets(args.vendor, args.device, args.plugin)
        resolved = [resolve_target(vendor, device, args.plugin) for vendor, device in plan]
    except GraphModeError as error:
        print(f"graphmode conformance: {error}", file=sys.stderr)
        return 2
    runs = []
    for index, ((vendor, device), target) in enumerate(zip(plan, resolved, strict=True), start=1):
        print(f"== vendor {index}/{len(plan)}: {target.vendor.name} on {target.device} ==", flush=True)
        for line in describe(target):
            print(f"   {line}", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if target.device.type == "cpu":
            # The suite's model is tiny: a second thread per process only adds
            # contention (eight times slower on a loaded 2-core machine).
            env.setdefault("OMP_NUM_THREADS", "1")
        with tempfile.TemporaryDirectory() as scratch:
            report = Path(scratch) / "report.json"
            command = [
                sys.executable, "-m", "pytest", str(SUITE), "-p", "graphmode_conformance.plugin",
                "-p", "no:cacheprovider", "-q", "--rootdir", str(SUITE.parent),
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
            if args.keyword:
                command += ["-k", args.keyword]
            command += args.pytest_args
            started = time.perf_counter()
            status = subprocess.call(command, env=env)
            elapsed = time.perf_counter() - started
            data = json.loads(report.read_text()) if report.exists() else {"records": [], "device": device}
        data.update(vendor=data.get("vendor") or vendor, exit_status=status, seconds=round(elapsed, 1))
        runs.append(data)
    print_summary(runs)
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
        result = "PASS" if run["exit_status"] == 0 else f"FAIL (exit {run['exit_status']})"
        print(f"{run['vendor']:16s} {str(run.get('device')):8s} " + " ".join(f"{counts[o]:8d}" for o in outcomes)
              + f" {run['seconds']:6.1f}s  {result}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphmode conformance", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
