"""What `pip show graphmode` and an index page read from the project's
metadata: a license (SPDX, PEP 639), an author, and a classifier for each
Python the project runs on, this one included (the GPU machine runs 3.12;
the classifiers stopped at 3.11). Read from pyproject.toml, the source of
the installed metadata."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]


def test_the_project_names_its_license_and_authors():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert PROJECT["authors"] and all(author.get("name") for author in PROJECT["authors"])


def test_a_classifier_names_the_python_running_the_tests():
    floor = int(PROJECT["requires-python"].removeprefix(">=3."))
    listed = {int(c.rsplit(".", 1)[1]) for c in PROJECT["classifiers"] if c.startswith("Programming Language :: Python :: 3.")}
    assert sys.version_info[:2] >= (3, floor)
    assert sys.version_info.minor in listed, f"pyproject.toml's classifiers list Python 3.{sorted(listed)}, not this 3.{sys.version_info.minor}"
    assert listed == set(range(floor, max(listed) + 1)), "a gap in the Python classifiers"
    assert max(listed) >= 12  # the GPU machine's Python
