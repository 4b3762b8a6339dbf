"""A device named on a command line, or one line saying why it cannot be had
here: for ``graphmode bench``, the tensor-parallel conformance run and the
GPU scripts (``scripts/``), so that a CPU-only torch stops each of them the
same way instead of in a traceback from inside torch."""

from __future__ import annotations

import difflib
from pathlib import Path

import torch

from graphmode.vendor_info import device_available

__all__ = ["DEVICE_ALIASES", "device_guess", "require_gpu", "script_device", "usable_device"]

# What a user may call a device, and torch's name for it.
DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "rocm": "cuda", "ascend": "npu", "camb": "mlu",
                  "cambricon": "mlu", "maca": "cuda", "metax": "cuda", "ppu": "cuda"}
_KNOWN = ("cpu", "cuda", "npu", "mlu", "xpu", "mps", "meta")
EMULATOR_HINT = "pass --device cpu for the CPU graph emulator"


def device_guess(text: str) -> str | None:
    """The device ``text`` most likely meant: an alias (gpu: cuda), else the
    closest device type torch or a vendor names; None when nothing is close."""
    name, _, index = text.lower().partition(":")
    suffix = f":{index}" if index else ""
    if name in DEVICE_ALIASES:
        return DEVICE_ALIASES[name] + suffix
    close = difflib.get_close_matches(name, _KNOWN, n=1)
    return close[0] + suffix if close else None


def usable_device(text: str, who: str, flag: str | None = "--device", hint: str = EMULATOR_HINT) -> torch.device:
    """``text`` as a device this process can use, or ``SystemExit`` with one
    line: ``who`` (the command), what was asked (``flag text``), why it cannot
    be had (torch does not know the name, with a guess; or has no such
    device here) and ``hint``."""
    asked = f"{flag or 'device'} {text}"
    try:
        device = torch.device(text)
    except RuntimeError:
        guess = device_guess(text)
        raise SystemExit(f"{who}: {flag or 'device'} {text!r} is not a device torch {torch.__version__} knows"
                         f"{f'; did you mean {guess}?' if guess else ''} (a vendor's device needs its extension "
                         f"installed and loading); {hint}") from None
    usable, why = device_available(device)
    if not usable:
        raise SystemExit(f"{who}: {asked}: {why} (torch {torch.__version__}{_build(device)}); {hint}")
    return device


def require_gpu(script: str) -> torch.device:
    """For a script that measures a GPU: its CUDA device, or one line saying
    there is none here (``script``: the script's ``__file__``)."""
    return usable_device("cuda", _script(script), flag=None,
                         hint="it measures a GPU: run it on a machine with one (docs/performance.md)")


def script_device(script: str, text: str) -> torch.device:
    """For a script with ``--device`` (``text``; cpu runs it on the CPU graph
    emulator): that device, or one line saying why it cannot be had here."""
    return usable_device(text, _script(script))


def _script(path: str) -> str:
    return f"scripts/{Path(path).name}"


def _build(device: torch.device) -> str:
    """Where torch is a CPU build, so that no driver or device can help."""
    if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
        return ", a CPU-only build"
    return ""
