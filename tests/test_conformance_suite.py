"""The conformance suite itself: it passes for every installed vendor on the
emulator, and it fails, for the right reason, on every deliberately broken
vendor while passing on the correct originals those vary."""

from __future__ import annotations

import json

import pytest

from graphmode_conformance import cli
from graphmode_conformance.broken import BROKEN, ORIGINALS

pytestmark = pytest.mark.slow

# What the first failure of each broken plugin must say.
DIAGNOSES = {
    "slot_zero_padding": "kv_start_indices padding [0] (must be -1: no KV write)",
    "stale_padding": "padding rows 9..9 are not neutral",
    "context_not_on_buffer": "attn_metadata.kv_seqlens of the graph context is not a view of an input buffer",
    "frozen_max_len": "A graph freezes host values, so every replay would use the capture step's max length",
    "kv_lengths_never_pushed": "on the device this replay would hang",
    "bucket_below_batch": "graphmode_compatible_size(9) returned 8; it must be a capture size >= 9",
    "captured_at_batch_size": "has 9 rows for a batch of 9 in bucket 10; graphs must be captured at their bucket's size",
    "unsliced_outputs": "Likely cause: outputs not cut to the live tokens",
    "minus_one_max_len": "max_kv_seq_len=-1: PPU's FlashAttention varlen kernel needs a positive upper bound",
}


def run_suite(tmp_path, *args: str) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    status = cli.main(["--report", str(report), *args])
    return status, json.loads(report.read_text())


def failures(report: dict) -> list[dict]:
    return [r for run in report["runs"] for r in run["records"] if r["outcome"] in ("failed", "error")]


def test_every_bug_class_has_a_broken_plugin_and_a_diagnosis():
    assert set(BROKEN) == set(DIAGNOSES)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_suite_fails_on_a_broken_vendor_for_the_right_reason(name, tmp_path):
    status, report = run_suite(tmp_path, "--plugin", f"graphmode_conformance.broken:{name}", "--", "-x")
    assert status != 0
    failed = failures(report)
    assert failed, f"{name}: the suite reported no failure"
    assert DIAGNOSES[name] in failed[0]["message"], failed[0]["message"]


@pytest.mark.parametrize("name", sorted(ORIGINALS))
def test_the_suite_passes_on_the_correct_originals(name, tmp_path):
    status, report = run_suite(tmp_path, "--plugin", f"graphmode_conformance.broken:{name}")
    assert status == 0, failures(report)


def test_graphmode_conformance_passes_for_every_installed_vendor_on_the_emulator(tmp_path, capfd):
    status, report = run_suite(tmp_path)
    summary = capfd.readouterr().out
    assert status == 0, summary
    assert {run["vendor"] for run in report["runs"]} == {"cuda", "ascend", "camb", "maca", "ppu"}
    assert all(run["device"] == "cpu" for run in report["runs"])
    assert "== graphmode conformance summary ==" in summary


def test_ascend_passes_on_the_task_group_update_path(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHMODE_ASCEND_UPDATE_PATH", "task_group")
    status, report = run_suite(tmp_path, "--vendor", "ascend", "--device", "cpu")
    assert status == 0, failures(report)


def test_xfails_file_marks_tests_and_reports_ids_matching_nothing(tmp_path, capfd):
    xfails = tmp_path / "xfails.txt"
    xfails.write_text(
        "# known problems of this vendor\n"
        "test_padding_is_neutral_after_a_larger_batch  # upstream keeps stale padding\n"
        "test_that_does_not_exist\n"
    )
    status, report = run_suite(
        tmp_path, "--plugin", "graphmode_conformance.broken:stale_padding", "--xfails", str(xfails),
        "-k", "padding_is_neutral or vendor_describes",
    )
    records = {r["test"]: r for r in report["runs"][0]["records"]}
    assert records["test_padding_is_neutral_after_a_larger_batch"]["outcome"] == "xfailed"
    assert records["test_vendor_describes_itself"]["outcome"] == "passed"
    assert status == 0
    assert "xfail ids matching no test: test_that_does_not_exist" in capfd.readouterr().out


def test_report_header_names_vendor_device_and_versions(tmp_path):
    status, report = run_suite(tmp_path, "--vendor", "maca", "--device", "cpu", "-k", "vendor_describes")
    header = "\n".join(report["runs"][0]["header"])
    assert status == 0
    assert "vendor maca (plugin 0.1.0)" in header
    assert "device cpu (CPU graph emulator); torch" in header and "graphmode 0.1.0" in header
