"""The conformance command's own behaviour: clear refusals before any
pytest process starts, and what it prints per vendor."""

from __future__ import annotations

import argparse

from graphmode_conformance import cli


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
    assert rest[-1] == "Install the vendor's package (pip install graphmode[acme]) or pick one above."


def test_plugin_option_is_documented_in_help():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert "--plugin MODULE:OBJECT" in parser.format_help()


def test_each_vendor_run_starts_with_its_header(capfd):
    status = cli.run(_args("--vendor", "cuda", "--device", "cpu", "-k", "test_vendor_describes_itself"))
    out = capfd.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    start = lines.index("== vendor 1/1: cuda on cpu ==")
    header = "\n".join(lines[start + 1: start + 5])
    assert "vendor cuda (plugin" in header and "device cpu (CPU graph emulator); torch" in header
    assert "capture list at the suite's max_batches=48: [1, 2, 3" in header
