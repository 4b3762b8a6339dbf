"""When torch fails to import because a device backend it auto-loads fails
(torch_npu without CANN), every ``graphmode`` command says why and how to run
anyway, instead of a traceback. The backend here is a real ``torch.backends``
entry point of a real (tiny) distribution, whose import really fails to load
a shared library, as torch_npu's does without CANN."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hangs
import pytest

MISSING_LIBRARY = "libgraphmode_test_hccl.so"
GRAPHMODE = Path(sys.executable).with_name("graphmode")


@pytest.fixture(scope="module")
def broken_backend(tmp_path_factory) -> Path:
    """A directory holding a distribution with a failing torch backend."""
    site = tmp_path_factory.mktemp("site")
    package = site / "fake_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import ctypes\n"
        f"ctypes.CDLL({MISSING_LIBRARY!r})  # a vendor library that is not installed\n"
        "def _autoload():\n    pass\n"
    )
    info = site / "fake_npu-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-npu\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nfake_npu = fake_npu:_autoload\n")
    return site


def _run(command: list[str], site: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {name: value for name, value in os.environ.items() if name != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    environ.update(env)
    return hangs.run(command, ci_seconds=10, env=environ, capture_output=True, text=True)


def test_the_backend_really_breaks_import_torch(broken_backend):
    result = _run([sys.executable, "-c", "import torch"], broken_backend)
    assert result.returncode != 0
    assert "Failed to load the backend extension: fake_npu" in result.stderr


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "graphmode", "vendors"],
        [str(GRAPHMODE), "vendors"],
        [str(GRAPHMODE), "conformance", "--vendor", "cuda"],
        [str(GRAPHMODE), "bench"],
    ],
    ids=["python -m graphmode vendors", "graphmode vendors", "graphmode conformance", "graphmode bench"],
)
def test_every_command_prints_advice_not_a_traceback(broken_backend, command):
    result = _run(command, broken_backend)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "auto-loads the device backend 'fake_npu' (fake-npu 1.2.3, entry point fake_npu:_autoload)" in result.stderr
    assert f"OSError: {MISSING_LIBRARY}: cannot open shared object file" in result.stderr
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in result.stderr


def test_the_advice_works(broken_backend):
    result = _run([sys.executable, "-m", "graphmode", "vendors"], broken_backend, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 0, result.stderr
    assert "ppu (" in result.stdout
