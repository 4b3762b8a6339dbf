"""The ``graphmode`` command itself: ``--help`` and ``--version`` without
torch, the version from the installed metadata, the command list, and the
default invocation of ``graphmode vendors`` (``bench`` and ``conformance``:
tests/test_bench.py, tests/test_conformance_cli.py), and what the package declares and ships."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import hangs
import pytest

import graphmode
from graphmode.cli.main import COMMANDS, main
from graphmode.plugins import installed_vendor_names

ROOT = Path(__file__).resolve().parent.parent

# Runs the command's main, then says whether torch was imported on the way.
IMPORTS_TORCH = """
import sys
from graphmode.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []], ids=["--help", "--version", "no command"])
def test_help_and_version_import_no_torch(argv):
    result = hangs.run([sys.executable, "-c", IMPORTS_TORCH.format(argv=argv)], ci_seconds=3,
                       capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "torch imported: False", result.stdout


def test_the_version_is_the_installed_distribution_s(capsys):
    assert graphmode.__version__ == importlib.metadata.version("graphmode")
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"graphmode {graphmode.__version__}\n"


def test_no_command_lists_the_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: graphmode")
    for name, text in COMMANDS.items():
        assert f"  {name:13s} {text}" in out


def test_a_command_s_help_lists_its_own_options(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: graphmode bench") and "--vendors VENDORS" in out and "--workload" in out


def test_a_command_gets_every_argument_after_it_pytest_s_after_the_separator(capfd):
    """The command's own parser reads what follows the command, ``--`` and
    what follows it (pytest's arguments) included."""
    assert main(["conformance", "--vendor", "cuda", "--device", "cpu", "-k", "test_vendor_describes_itself",
                 "--", "-v"]) == 0
    assert "test_vendor_describes_itself PASSED" in capfd.readouterr().out


def test_vendors_with_its_defaults_lists_every_installed_vendor(capsys):
    assert main(["vendors"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split(" (")[0] for line in lines if not line.startswith(" ") and not line.startswith("chosen")]
    assert names == installed_vendor_names()
    assert sum("capture list for max_batches=256" in line for line in lines) == len(names)
    assert lines[-1].startswith("chosen here: ")


def test_the_package_declares_its_license_and_ships_its_type_hints():
    """What a wheel carries (checked on a built wheel once: LICENSE under
    dist-info/licenses, every package's py.typed; the native step's C++
    source, which it builds on first use): the pyproject fields that put
    them there, in the form setuptools >= 77 requires (PEP 639)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["build-system"]["requires"] == ["setuptools>=77"]
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert not [c for c in project["project"]["classifiers"] if c.startswith("License ::")]  # PEP 639 forbids both
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    package_data = project["tool"]["setuptools"]["package-data"]
    assert package_data == {"*": ["py.typed"], "graphmode.native": ["step.cpp"]}
    assert (ROOT / "core" / "graphmode" / "native" / "step.cpp").exists()
    for where in project["tool"]["setuptools"]["packages"]["find"]["where"]:
        packages = [p for p in (ROOT / where).iterdir() if (p / "__init__.py").exists()]
        assert packages and all((p / "py.typed").exists() for p in packages), where


# torch_npu releases on PyPI and the torch release each requires (Requires-Dist
# of their cp311 x86_64 wheels, read 2026-11-25; up to 2.10 the +cpu build).
TORCH_NPU_TORCH = {
    "2.5.1": "2.5.1", "2.6.0.post5": "2.6.0", "2.9.0.post9": "2.9.0", "2.10.0.post7": "2.10.0",
    "2.12.0.post3": "2.12.0", "2.13.0": "2.13.0", "2.14.0": "2.14.0",
}


def test_the_ascend_extra_admits_the_torch_npu_of_every_supported_torch_only():
    """Unpinned, ``pip install graphmode[ascend]`` took the newest torch_npu
    and replaced the user's torch with that torch_npu's torch."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (extra,) = [Requirement(text) for text in project["optional-dependencies"]["ascend"]]
    assert extra.name == "torch-npu"
    (torch_requirement,) = [Requirement(text) for text in project["dependencies"] if text.startswith("torch")]
    low, high = re.search(r"\*\*Supported torch: (\S+) to (\S+)\.\*\*", (ROOT / "README.md").read_text()).groups()
    for release, torch_release in TORCH_NPU_TORCH.items():
        supported = torch_release in torch_requirement.specifier and Version(torch_release).release[:2] <= Version(high).release
        assert (release in extra.specifier) == supported, (release, torch_release, low, high)
