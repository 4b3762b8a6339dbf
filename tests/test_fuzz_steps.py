"""A smoke run of scripts/fuzz_steps.py: a few hundred random legal steps
over the five vendors (speculative verify with rollback, chunked prefill,
kv_seqlens_cpu sometimes omitted or unmarked, padding rows of no token in
every position), each against eager on the same inputs: no refusal, no
mismatch, no KV byte written outside the step's slots."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import fuzz_steps  # noqa: E402


def test_a_few_hundred_fuzzed_steps_find_nothing(capsys):
    tallies = [fuzz_steps.fuzz_vendor(vendor, 60, seed=1, epoch=30) for vendor in fuzz_steps.VENDORS]
    for tally in tallies:
        assert (tally.refusals, tally.mismatches, tally.foreign_bytes) == (0, 0, 0), tally.examples
    kinds = sum((tally.kinds for tally in tallies), start=fuzz_steps.Counter())
    for carried in ("padding row first", "padding row middle", "padding row last", "kv_seqlens_cpu omitted",
                    "kv_seqlens_cpu unmarked", "chunked prefill", "verify", "decode"):
        assert kinds[carried] > 0, carried


def test_the_summary_line(capsys):
    assert fuzz_steps.main(["--steps", "20", "--vendors", "maca,ascend", "--workers", "0"]) == 0
    assert capsys.readouterr().out.strip() == "steps 20, refusals 0, mismatches 0, foreign KV bytes 0"
