"""``graphmode vendors``: every installed vendor, usable or not and why, its
runtime version, and its capture list for a given maximum batch."""

from __future__ import annotations

import argparse

import torch

from graphmode.config import RunnerConfig
from graphmode.plugins import vendor_statuses


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-batches", type=int, default=256, help="maximum batch for the capture lists")


def run(args: argparse.Namespace) -> int:
    for name, vendor, status in vendor_statuses():
        print(f"{name} ({vendor.version if vendor else 'not loaded'})")
        print(f"  {status}")
        if vendor is None:
            continue
        info = vendor.info
        devices = ", ".join(
            f"{t}: {'yes' if ok else 'no'} ({why})"
            for t in (*info.device_types, "cpu")
            for ok, why in [info.runs_on(torch.device(t)) if _known(t) else (False, f"torch has no {t} device")]
        )
        print(f"  graphs on: {devices}")
        config = RunnerConfig(args.max_batches, 1, 16, torch.device("cpu"), num_layers=None)
        vendor.hook.graphmode_check_config(config=config)
        sizes = vendor.hook.graphmode_capture_sizes(config=config)
        print(f"  capture list for max_batches={args.max_batches}: {len(sizes)} graphs {sizes}")
        if info.capabilities:
            print(f"  capabilities: {', '.join(sorted(info.capabilities))}")
    return 0


def _known(device_type: str) -> bool:
    try:
        torch.device(device_type)
        return True
    except RuntimeError:
        return False
