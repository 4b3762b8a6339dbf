"""Print every graph-semantics case on the emulator and on CUDA, side by side.

    python scripts/compare_graph_semantics.py      # needs a CUDA device

Without one, only the emulator side runs: each case is checked against its
expected result, and the CUDA side is reported skipped (nothing is compared).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import graph_semantics_cases as cases  # noqa: E402


def cuda_missing() -> str | None:
    """Why the CUDA side cannot run here, or None when it can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def main() -> int:
    sides = [cases.Backend(torch.device("cpu"))]
    missing = cuda_missing()
    if missing is None:
        sides.append(cases.Backend(torch.device("cuda")))
    bad = 0
    print(f"torch {torch.__version__}; " + ", ".join(
        f"{b.name}: {torch.cuda.get_device_name() if b.name == 'cuda' else 'CPU emulator'}" for b in sides))
    if missing:
        print(f"CUDA side skipped: {missing}. Only the emulator ran, each case checked against its expected "
              "result; nothing is compared with CUDA (run this where torch sees a CUDA device)")
    for case in cases.CASES:
        seen = [cases.run(case, b) for b in sides]
        right = all(s == cases.expected(case, b) for s, b in zip(seen, sides))
        agree = case in cases.PER_SIDE or all(s == seen[0] for s in seen)
        if missing:
            verdict = "as expected" if right else "UNEXPECTED"
        else:
            verdict = ("agree" if agree else "DIFFER") + ("" if right else ", UNEXPECTED")
        bad += not (right and agree)
        note = " (differs by nature, each side checked)" if case in cases.PER_SIDE and not missing else ""
        print(f"{case:36s} {verdict}{note}")
        for b, s in zip(sides, seen):
            print(f"    {b.name:9s} {s}")
    if bad:
        print(f"{bad} cases unexpected")
    else:
        print("all cases as expected" + (" on the emulator; the CUDA side was skipped" if missing else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
