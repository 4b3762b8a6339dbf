"""``graphmode vendors``: every installed vendor, usable or not and why, its
runtime version, and its capture list for a given maximum batch (with its
declared largest graph, above which batches run eagerly)."""

from __future__ import annotations

import argparse
import os

import torch

from graphmode.buckets import largest_graph_declaration
from graphmode.errors import GraphModeError
from graphmode.plugins import BUILTIN_VENDOR, ENV_VENDOR, Vendor, select_vendor, vendor_statuses
from graphmode.runner.setup import default_capture_sizes
from graphmode.spec import BufferSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-batches", type=int, default=256, help="maximum batch for the capture lists")


def run(args: argparse.Namespace) -> int:
    for name, vendor, status in vendor_statuses():
        print(f"{name} ({vendor.version if vendor else 'not loaded'})")
        print(f"  {status}")
        if vendor is None:
            continue
        try:
            _describe(vendor, args.max_batches)
        except Exception as error:  # one broken plugin must not hide the others
            print(f"  error: {type(error).__name__}: {error}".splitlines()[0])
    print(_choice())
    return 0


def _choice() -> str:
    """Which vendor graphmode would take here with no vendor= and why."""
    try:
        chosen = select_vendor()
    except GraphModeError as error:
        return f"chosen here: none ({error})".splitlines()[0]
    if os.environ.get(ENV_VENDOR):
        why = f"${ENV_VENDOR}={os.environ[ENV_VENDOR]}"
    elif chosen.name != BUILTIN_VENDOR:
        why = f"the only vendor whose hardware is detected: {chosen.info.reason}"
    else:
        why = "no other vendor's hardware is detected, so the built-in default answers"
    return f"chosen here: {chosen.name} ({why})"


def _describe(vendor: Vendor, max_batches: int) -> None:
    info = vendor.info
    devices = ", ".join(
        f"{t}: {'yes' if ok else 'no'} ({why})"
        for t in (*info.device_types, "cpu")
        for ok, why in [info.runs_on(torch.device(t)) if _known(t) else (False, f"torch has no {t} device")]
    )
    print(f"  graphs on: {devices}")
    if info.capabilities:
        print(f"  capabilities: {', '.join(sorted(info.capabilities))}")
    spec = vendor.spec
    blocks = "any" if spec.block_sizes is None else ", ".join(map(str, spec.block_sizes))
    tokens = "any number of tokens" if spec.max_q_len is None else f"up to {spec.max_q_len} token(s)"
    print(f"  block sizes: {blocks}; decode graphs of {tokens} per sequence (max_q_len); graph maxima: "
          f"max_q_seq_len {spec.max_q_policy}, max_kv_seq_len {spec.max_kv_policy}; options: {spec.options.__name__}")
    print("  buffers: " + "; ".join(_buffer(b) for b in spec.buffers))
    sizes = list(default_capture_sizes(vendor, max_batches))
    largest = ""
    if spec.max_capture_size is not None:
        declared = largest_graph_declaration(spec.capture_policy, spec.max_capture_size)
        largest = f"; largest graph {spec.max_capture_size} ({declared})"
    if sizes[-1] < max_batches:
        largest += f"; batches {sizes[-1] + 1}..{max_batches} run eagerly"
    print(f"  capture list for max_batches={max_batches}: {len(sizes)} graphs {sizes}{largest}")


def _buffer(spec: BufferSpec) -> str:
    """One declared buffer in a line's worth: name, dtype, shape, where its
    live rows come from (unless its own context field), padding, memory."""
    dtype = str(spec.dtype).removeprefix("torch.")
    shape = ", ".join(map(str, spec.shape))
    if spec.live is not None:
        fill = f"live {spec.live}, "
    elif not spec.written:
        fill = "constant, "
    elif callable(spec.source):
        fill = "computed from the step, "
    elif spec.source != "default":
        fill = f"from {' or '.join(spec.sources)}, "
    else:
        fill = ""
    scaled = " x q_len" if spec.q_len_scaled else ""
    return f"{spec.name} {dtype} ({shape}) {fill}pad {spec.padding}{scaled}{', host' if spec.host else ''}"


def _known(device_type: str) -> bool:
    try:
        torch.device(device_type)
        return True
    except RuntimeError:
        return False
