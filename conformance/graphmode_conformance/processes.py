"""The pytest process of one vendor's run (``graphmode conformance``).

Every run is a process of its own, so that one vendor's failure or crash
cannot hide another's result. Runs on the CPU emulator are forked from a
server process that imported torch, pytest and graphmode once
(:mod:`multiprocessing`'s forkserver): a fresh interpreter spends about 6 s
of CPU on those imports before its first test (3.5 s of it importing torch,
on a 2-core machine), which the five emulated vendors of the main job, and
the test suite's hundred-odd runs of broken plugins, would pay every time.
The server runs nothing but those imports, so no thread or device state is
forked with it. Runs on an accelerator start a fresh interpreter as before
(``python -m pytest``): a device runtime imported into the server (torch_npu
by torch's backend autoload, say) might not survive a fork.

A forked run gets what a fresh one would: the caller's environment (applied
before pytest starts, so every variable graphmode and the suite read at run
time holds; torch's intra-op threads follow ``OMP_NUM_THREADS``), working
directory, import path and standard output and error. torch itself was
imported once, by the server, with the environment of the first run: a run
whose ``TORCH*`` variables differ from those starts a fresh interpreter.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Mapping
from multiprocessing import reduction
from typing import Any

#: What the server imports once, for every forked run: torch's Dynamo too, which every run imports
#: (torch wraps each TorchDispatchMode's dispatch, the emulator's, in a Dynamo guard).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "pytest", "graphmode", "graphmode_conformance",
           "graphmode_conformance.plugin"]

_server: dict[str, Any] = {}  # "context", and "torch_env": the TORCH* variables the server imported torch with


def run_pytest(args: list[str], env: Mapping[str, str], *, fork: bool) -> int:
    """``python -m pytest ARGS`` in a process of its own with environment
    ``env``; its exit status. ``fork``: fork it from the preloaded server (a
    run on the CPU emulator), else start a fresh interpreter."""
    if not fork or _torch_env(env) != _server.setdefault("torch_env", _torch_env(os.environ)):
        return subprocess.call([sys.executable, "-m", "pytest", *args], env=dict(env))
    context = _server.get("context")
    if context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _server["context"] = context
    sys.stdout.flush()
    sys.stderr.flush()
    child = context.Process(target=_run, args=(list(args), dict(env), os.getcwd(), _CallerStdio()),
                            name="graphmode conformance")
    child.start()
    try:
        child.join()
    except BaseException:  # Ctrl-C: the child got it too (one process group); do not leave it behind
        child.terminate()
        child.join()
        raise
    return child.exitcode if child.exitcode is not None else 1


def _torch_env(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(("TORCH", "PYTORCH"))}


class _CallerStdio:
    """The caller's file descriptors 1 and 2, sent with the request to fork:
    a forked child would otherwise write to the server's, which were the
    caller's when the server started (under pytest's ``capfd``, an earlier
    test's capture file)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Called while the request is pickled: DupFd then sends the descriptors along with it.
        return (_detached, (reduction.DupFd(1), reduction.DupFd(2)))


def _detached(*fds: Any) -> tuple[int, ...]:
    return tuple(fd.detach() for fd in fds)


def _run(args: list[str], env: dict[str, str], cwd: str, stdio: tuple[int, int]) -> None:
    """The forked child: become what ``python -m pytest ARGS`` started with
    ``env`` in ``cwd`` would be, then run pytest and exit with its status."""
    for target, fd in zip((1, 2), stdio, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # As `python -m` does: the working directory first, then PYTHONPATH's entries.
    sys.path[:0] = [cwd, *(path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path)]
    sys.argv = [sys.executable, "-m", "pytest", *args]
    if env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # read by OpenMP when the server loaded it, not since
    import pytest

    # The preloaded modules' objects are never garbage: keep every collection of the run (each
    # warm-up starts with one) from walking them again.
    gc.freeze()
    sys.exit(int(pytest.main(args)))
