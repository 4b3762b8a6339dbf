"""Print every graph-semantics case on the emulator and on CUDA, side by side.

    python scripts/compare_graph_semantics.py      # needs a CUDA device
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import graph_semantics_cases as cases  # noqa: E402


def main() -> int:
    sides = [cases.Backend(torch.device("cpu"))]
    if torch.cuda.is_available():
        sides.append(cases.Backend(torch.device("cuda")))
    bad = 0
    print(f"torch {torch.__version__}; " + ", ".join(
        f"{b.name}: {torch.cuda.get_device_name() if b.name == 'cuda' else 'CPU emulator'}" for b in sides))
    for case in cases.CASES:
        seen = [cases.run(case, b) for b in sides]
        right = all(s == cases.expected(case, b) for s, b in zip(seen, sides))
        agree = case in cases.PER_SIDE or all(s == seen[0] for s in seen)
        verdict = ("agree" if agree else "DIFFER") + ("" if right else ", UNEXPECTED")
        bad += not (right and agree)
        note = " (differs by nature, each side checked)" if case in cases.PER_SIDE else ""
        print(f"{case:36s} {verdict}{note}")
        for b, s in zip(sides, seen):
            print(f"    {b.name:9s} {s}")
    print("all cases as expected" if not bad else f"{bad} cases unexpected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
