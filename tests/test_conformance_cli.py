"""The conformance command's own behaviour: clear refusals before any
pytest process starts, and what it prints per vendor."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

import graphmode
from graphmode.errors import ConfigError
from graphmode_conformance import cli
from graphmode_conformance.plugin import Target

TESTS = Path(__file__).parent


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_mistaken_vendor_name_is_one_clear_error(capsys):
    assert cli.run(_args("--vendor", "acme")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no pytest process was started
    first, *rest = captured.err.splitlines()
    assert first == "graphmode conformance: no vendor plugin named 'acme' is installed. Installed vendors:"
    assert rest[-1] == (  # graphmode has no acme extra: the vendor's own package
        "Install the vendor's package (the package that ships it; a plugin package declares `NAME = module` under "
        "[project.entry-points.graphmode] in its pyproject.toml) or pick one above."
    )


def test_plugin_and_size_options_are_documented_in_help():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    text = parser.format_help()
    assert "--plugin MODULE:OBJECT" in text
    for flag in ("--block-size", "--max-batches", "--capture-sizes 1,3,6", "--dtype", "--table-width"):
        assert flag in text


def test_a_size_the_suite_cannot_run_is_one_clear_error(capsys):
    assert cli.run(_args("--vendor", "cuda", "--device", "cpu", "--max-batches", "4")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "graphmode conformance: conformance sizes: max_batches=4; the suite's steps hold up to 12 sequences: use >= 12"
    )


def test_a_block_size_the_vendor_does_not_take_is_one_clear_error_before_any_test(capsys):
    # Every test would fail on it, each with the runner's error (an outsider's run: 6 of 6 failed).
    assert cli.run(_args("--vendor", "camb", "--device", "cpu", "--block-size", "8")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "graphmode conformance: --block-size 8: vendor 'camb' takes KV-cache blocks of 16 tokens "
        "(GraphSpec.block_sizes); pass --block-size 16, or leave it out for the vendor's first declared size"
    )


def test_runs_on_cuda_check_host_reads_on_the_replay_path(monkeypatch):
    monkeypatch.delenv("GRAPHMODE_CHECK_HOST_READS", raising=False)
    vendor = graphmode.load_vendor("cuda")
    assert cli.process_env(Target(vendor, torch.device("cuda")), None)["GRAPHMODE_CHECK_HOST_READS"] == "1"
    assert "GRAPHMODE_CHECK_HOST_READS" not in cli.process_env(Target(vendor, torch.device("cpu")), None)


def test_each_vendor_run_starts_with_its_header(capfd):
    status = cli.run(_args("--vendor", "cuda", "--device", "cpu", "-k", "test_vendor_describes_itself"))
    out = capfd.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    start = lines.index("== vendor 1/1: cuda on cpu ==")
    header = "\n".join(lines[start + 1: start + 5])
    assert "vendor cuda (plugin" in header and "device cpu (CPU graph emulator); torch" in header
    assert "sizes: block size 16 (suite default), max_batches 48, block-table width 8, model dtype float32" in header
    assert "capture list at max_batches=48: [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20" in header
    assert "(the vendor's policy)" in header


@pytest.mark.parametrize("flag, verbose", [(None, False), ("-v", True), ("-vv", True)])
def test_a_verbosity_flag_after_the_separator_takes_effect(capfd, flag, verbose):
    """The suite runs quietly; ``-- -v`` lists every test by name (it used
    to cancel against the command's own -q and print dots)."""
    status = cli.run(_args("--vendor", "cuda", "--device", "cpu", "-k", "test_vendor_describes_itself",
                           *(["--", flag] if flag else [])))
    out = capfd.readouterr().out
    assert status == 0, out
    assert bool(re.search(r"test_vendor_describes_itself\b.* PASSED", out)) == verbose, out


def test_size_flags_reach_the_suite_and_its_header(tmp_path, capfd):
    report = tmp_path / "report.json"
    status = cli.run(_args(
        "--vendor", "cuda", "--device", "cpu", "--block-size", "32", "--max-batches", "24", "--capture-sizes", "1,3,6,12,24",
        "--dtype", "bfloat16", "--table-width", "10", "--report", str(report), "-k", "capture_list or buffers_are_made",
    ))
    out = capfd.readouterr().out
    assert status == 0, out
    assert "sizes: block size 32 (given), max_batches 24, block-table width 10, model dtype bfloat16" in out
    assert "capture list at max_batches=24: [1, 3, 6, 12, 24] (given)" in out
    records = json.loads(report.read_text())["runs"][0]["records"]
    # issue 40 added a capture-list test (the declared policy) that -k capture_list selects too
    assert {r["outcome"] for r in records} == {"passed"} and len(records) == 4


@pytest.mark.slow
def test_a_vendor_written_from_the_docs_passes_unchanged(capfd, monkeypatch):
    """tests/acme_vendor.py: block size 32, capture list [1, 3, 6, 12, 24, 48]
    from its declared policy, a per-token kernel input of its own, a user
    list trimmed to six sizes; the whole suite, from the tests directory."""
    monkeypatch.chdir(TESTS)
    status = cli.run(_args("--device", "cpu", "--plugin", "acme_vendor:plugin"))
    out = capfd.readouterr().out
    assert status == 0, out
    assert "sizes: block size 32 (declared by the vendor)" in out
    assert "capture list at max_batches=48: [1, 3, 6, 12, 24, 48] (the vendor's policy)" in out
    assert "acme             cpu" in out and "PASS" in out


def test_an_undetected_vendor_without_device_runs_on_the_emulator_and_says_so(capfd):
    """camb's own device type, mlu, is not one torch knows without torch_mlu:
    naming it once raised torch's RuntimeError from the command."""
    if graphmode.load_vendor("camb").info.detected:
        pytest.skip("camb is detected here")
    status = cli.run(_args("--vendor", "camb", "-k", "test_vendor_describes_itself"))
    out = capfd.readouterr().out
    assert status == 0, out
    assert "== vendor 1/1: camb on cpu ==" in out
    assert ("device cpu: camb is not detected here (torch_mlu is not installed), so its graphs run on the CPU "
            "graph emulator; on its hardware pass --device mlu") in out


def test_a_keyword_matching_no_test_says_so(capfd):
    status = cli.run(_args("--vendor", "cuda", "--device", "cpu", "-k", "no_such_test"))
    captured = capfd.readouterr()
    assert status == 1
    assert re.search(r"^cuda +cpu +0 +0 +0 +0 +0 +[0-9.]+s  NO TEST MATCHED$", captured.out, re.MULTILINE), captured.out
    assert ("graphmode conformance: no test of vendor cuda matched -k 'no_such_test'; `-- --collect-only -q` "
            "lists the test ids") in captured.err


def test_variant_selects_one_option_variant(capfd):
    """``-k "update_path=task_group"`` is not an expression pytest accepts;
    ``--variant`` takes the id as the test ids show it."""
    status = cli.run(_args("--vendor", "ascend", "--device", "cpu", "--variant", "update_path=task_group",
                           "-k", "test_every_batch_size", "--", "--collect-only", "-q"))
    out = capfd.readouterr().out
    assert status == 0, out
    assert "   option variants (GraphSpec.option_variants): only update_path=task_group (--variant)" in out
    assert "each test under every one" not in out  # the header says what runs, not every declared variant
    collected = [line for line in out.splitlines() if "::" in line]
    assert collected and all(line.endswith("[update_path=task_group]") for line in collected), out


@pytest.mark.parametrize(("vendor", "message"), [
    ("ascend", "option variant 'update_path=other' is not one the vendor declares (GraphSpec.option_variants: "
               "update_path=graph_update, update_path=task_group); pass one of those"),
    ("cuda", "option variant 'update_path=other': the vendor declares no option variants "
             "(GraphSpec.option_variants); leave the variant out"),
])
def test_an_undeclared_variant_is_one_clear_error(capsys, vendor, message):
    assert cli.run(_args("--vendor", vendor, "--device", "cpu", "--variant", "update_path=other")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == f"graphmode conformance: --variant: vendor {vendor}: {message}"


def test_a_plugin_module_not_on_the_path_is_one_clear_error(capsys, monkeypatch, tmp_path):
    """--plugin plugins.lumen:plugin run from the repository root rather than
    tests/ (the fourth outsider's slip): a traceback of ModuleNotFoundError
    from importlib, not the one line the other unresolvable targets get."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    assert cli.run(_args("--device", "cpu", "--plugin", "no_such_plugins.lumen:plugin")) == 2
    err = capsys.readouterr().err
    assert "--plugin no_such_plugins.lumen:plugin: no module 'no_such_plugins' on the import path" in err, err
    assert f"in the current directory ({tmp_path})" in err, err
    assert cli.run(_args("--device", "cpu", "--plugin", "graphmode_conformance:no_such_object")) == 2
    assert "module graphmode_conformance has no object 'no_such_object'" in capsys.readouterr().err
    assert cli.run(_args("--device", "cpu", "--plugin", "graphmode_zephyr.plugin")) == 2  # a dot for the colon
    assert ("--plugin graphmode_zephyr.plugin: give MODULE:OBJECT, a module and the object in it holding the hooks, "
            "joined by a colon (--plugin graphmode_zephyr.plugin:plugin;") in capsys.readouterr().err


def test_a_vendor_name_other_than_the_plugins_own_is_one_clear_error(capsys, monkeypatch):
    """--vendor acme --plugin of vendor lumen ran, every result reported as acme's, and only the test
    of graphmode_vendor_info failed (an outsider's report, 2026-12-04)."""
    monkeypatch.chdir(Path(__file__).parent)
    monkeypatch.setattr("sys.path", [str(Path(__file__).parent), *__import__("sys").path])
    assert cli.run(_args("--vendor", "acme", "--device", "cpu", "--plugin", "plugins.lumen:plugin")) == 2
    assert capsys.readouterr().err.strip() == (
        "graphmode conformance: --vendor acme --plugin plugins.lumen:plugin: the plugin's graphmode_vendor_info "
        "names 'lumen'; leave --vendor out (a plugin names itself) or pass --vendor lumen")


def test_an_xfails_file_that_is_not_there_is_one_clear_error(capsys, tmp_path):
    """docs/conformance.md's own example, `--xfails known.txt`, without the
    file: one line, no pytest process (each stopped in an INTERNALERROR)."""
    missing = tmp_path / "known.txt"
    assert cli.run(_args("--xfails", str(missing))) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"graphmode conformance: --xfails {missing}: no such file (a file of test ids expected to fail, one per "
        "line, '#' comments; docs/conformance.md)"
    )


def test_the_plugin_given_an_xfails_file_that_is_not_there_is_a_usage_error(tmp_path):
    """The pytest plugin alone (pytest -p graphmode_conformance.plugin): a
    usage error of one line, not an INTERNALERROR traceback."""
    import subprocess
    import sys

    missing = tmp_path / "known.txt"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(cli.SUITE), "-p", "graphmode_conformance.plugin", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "--graphmode-xfails", str(missing), "--collect-only", "-q"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout[-2000:] + result.stderr[-2000:]
    assert "INTERNALERROR" not in result.stdout + result.stderr
    assert result.stderr.strip() == f"ERROR: --graphmode-xfails {missing}: no such file (a file of test ids expected to fail)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_tensor_parallel_on_cuda_without_a_cuda_device_is_one_clear_error():
    """`torchrun ... graphmode_conformance.tensor_parallel --device cuda` on a
    CPU-only torch: each rank stops saying there is no GPU, as the graphmode
    command does (it raised AttributeError '_cuda_setDevice' at set_device)."""
    from graphmode_conformance import tensor_parallel

    with pytest.raises(SystemExit) as stop:
        tensor_parallel.main(["--device", "cuda"])
    assert str(stop.value).startswith(
        "graphmode_conformance.tensor_parallel: --device cuda: no cuda device is available to torch here (torch ")
    assert str(stop.value).endswith("; pass --device cpu to run it on the CPU graph emulator over gloo")
    assert "\n" not in str(stop.value)


def test_a_working_directory_that_would_shadow_graphmode_is_refused_in_one_line(tmp_path, capsys):
    """Run from the folder holding a clone (an outsider's first run,
    2026-12-02): each suite process, with the working directory first on
    sys.path, imported the clone's folder as a namespace package and every
    vendor failed with "cannot import name 'hookimpl' from 'graphmode'"."""
    (tmp_path / "graphmode").mkdir()
    with pytest.raises(ConfigError) as error:
        cli.check_working_directory(tmp_path)
    assert f"the working directory {tmp_path} holds 'graphmode'" in str(error.value), error.value
    assert "Run graphmode conformance from another directory" in str(error.value), error.value


def test_a_working_directory_holding_the_installed_package_itself_or_a_plugin_is_taken(tmp_path):
    cli.check_working_directory(Path(graphmode.__file__).parent.parent)  # core/, which holds graphmode/ itself
    (tmp_path / "graphmode_zeta").mkdir()  # a vendor's own package beside it
    cli.check_working_directory(tmp_path)
