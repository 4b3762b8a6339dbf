"""Warm-up progress (graphmode.runner.progress): the library writes nothing
to stderr; captures are records of the ``graphmode`` logger; a tqdm bar is
drawn on a terminal when tqdm is installed, and nothing without it."""

from __future__ import annotations

import io
import logging
import sys

import pytest
import torch
from setups import tiny_setup

from graphmode.runner.progress import CaptureProgress


class Terminal(io.StringIO):
    """Text written to a terminal: tqdm draws its bar only on one."""

    def isatty(self) -> bool:
        return True


def test_warmup_logs_every_capture_and_writes_nothing_to_stderr(capfd, caplog):
    setup = tiny_setup(max_batches=4)
    with caplog.at_level(logging.DEBUG, logger="graphmode"):
        setup.runner.warmup(setup.graph_cache)
    assert capfd.readouterr().err == ""  # not a terminal: no bar, and no lines of graphmode's own
    records = [r for r in caplog.records if r.name == "graphmode"]
    assert [r.getMessage() for r in records[:-1]] == [
        f"capturing bucket {bucket} ({index}/4), emulated graphs (host memory)"
        for index, bucket in enumerate([4, 3, 2, 1], start=1)
    ]
    assert [r.levelno for r in records] == [logging.DEBUG] * 4 + [logging.INFO]
    assert records[-1].getMessage().startswith("captured 4 graphs in ")


def test_a_bar_is_drawn_on_a_terminal():
    pytest.importorskip("tqdm")
    terminal = Terminal()
    with CaptureProgress(2, torch.device("cpu"), file=terminal) as report:
        report("capturing bucket 2 (1/2)")
        report("capturing bucket 1 (2/2)", True)
    drawn = terminal.getvalue()
    assert "graphmode: capturing" in drawn and "2/2" in drawn and "bucket 1 (2/2), emulated graphs" in drawn


@pytest.mark.parametrize("bar", [True, False], ids=["without tqdm", "progress=False"])
def test_no_bar_without_tqdm_or_when_asked_for_none(monkeypatch, caplog, bar):
    if bar:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError, as when not installed
        monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    terminal = Terminal()
    with caplog.at_level(logging.DEBUG, logger="graphmode"):
        with CaptureProgress(1, torch.device("cpu"), bar=bar, file=terminal) as report:
            report("capturing bucket 1 (1/1)", True)
    assert terminal.getvalue() == ""
    assert [r.getMessage() for r in caplog.records][0] == "capturing bucket 1 (1/1), emulated graphs (host memory)"
