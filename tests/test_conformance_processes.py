"""The vendor runs' pytest processes (graphmode_conformance.processes): a run
forked from the preloaded server behaves as a fresh ``python -m pytest``
would, in environment, directory, import path, threads, output and exit
status; a run it cannot fork alike starts a fresh interpreter."""

from __future__ import annotations

import os

from graphmode_conformance.processes import run_pytest

PROBE = """
import os, sys, torch

def test_probe():
    forked = os.getppid() != int(os.environ["CALLER"])
    print(f"probe {os.environ['PROBE']} cwd={os.getcwd()} path0={sys.path[0]} "
          f"threads={torch.get_num_threads()} forked={forked}")
    assert os.environ["PROBE"] != "fail"
"""


def _probe(tmp_path, monkeypatch, **env: str) -> tuple[int, list[str]]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    given = {**os.environ, "CALLER": str(os.getpid()), "OMP_NUM_THREADS": "1", **env}
    status = run_pytest(["test_probe.py", "-q", "-s", "-p", "no:cacheprovider"], given, fork=True)
    return status, given


def test_a_forked_run_has_the_callers_environment_directory_threads_and_output(tmp_path, monkeypatch, capfd):
    status, _ = _probe(tmp_path, monkeypatch, PROBE="yes", OMP_NUM_THREADS="2")
    out = capfd.readouterr().out  # the child wrote to this test's descriptor 1, not the server's
    assert status == 0, out
    assert f"probe yes cwd={tmp_path} path0={tmp_path} threads=2 forked=True" in out, out


def test_a_forked_run_returns_pytests_exit_status(tmp_path, monkeypatch, capfd):
    status, _ = _probe(tmp_path, monkeypatch, PROBE="fail")
    out = capfd.readouterr().out
    assert status == 1, out
    assert "1 failed" in out, out


def test_a_run_whose_torch_variables_differ_from_the_servers_starts_a_fresh_interpreter(tmp_path, monkeypatch, capfd):
    # torch read its variables when the server imported it: a run asking for others cannot be forked.
    _probe(tmp_path, monkeypatch, PROBE="first")  # the server exists, with this environment
    status, _ = _probe(tmp_path, monkeypatch, PROBE="yes", TORCH_SHOW_CPP_STACKTRACES="1")
    out = capfd.readouterr().out
    assert status == 0, out
    assert "probe yes" in out and "forked=False" in out, out


def test_an_accelerator_run_starts_a_fresh_interpreter(tmp_path, monkeypatch, capfd):
    (tmp_path / "test_probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "CALLER": str(os.getpid()), "PROBE": "yes"}
    status = run_pytest(["test_probe.py", "-q", "-s", "-p", "no:cacheprovider"], env, fork=False)
    out = capfd.readouterr().out
    assert status == 0, out
    assert "forked=False" in out, out
