"""Hang catches: every wait in the tests that could block for ever (a
subprocess, a thread, a queue) is bounded, so that a hang fails the test
instead of stalling CI. A bound says nothing about speed.

Each bound is ten times what the wait takes in CI (an idle 2-core machine
running ``pytest -n auto``), and at least two minutes, so that a machine five
times slower still passes with room to spare. (The floor is for the waits
of seconds, a fresh Python importing torch among them: on this project's
shared 2-core machine at a load average of 18, with the tests niced, such a
child took more than a minute.) A wait that runs out fails
saying that it is a timeout, and what hung."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

FACTOR = 10
FLOOR_SECONDS = 120.0


def bound(ci_seconds: float) -> float:
    """The hang catch for a wait that takes ``ci_seconds`` in CI."""
    return max(FLOOR_SECONDS, FACTOR * ci_seconds)


def _timed_out(what: str, seconds: float, ci_seconds: float, output: str = "") -> None:
    pytest.fail(f"timeout (a hang catch, not a speed check): {what} did not finish in {seconds:g} s, "
                f"{FACTOR}x the {ci_seconds:g} s it takes in CI" + (f"; its output so far:\n{output}" if output else ""),
                pytrace=False)


def run(command: Sequence[str], *, ci_seconds: float, check: bool = False, capture_output: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, ...)`` under a hang catch. The command runs
    in a session of its own, so that a timeout kills its children too (the
    workers torchrun starts, say), not only the process it started."""
    seconds = bound(ci_seconds)
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(list(command), start_new_session=True, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            output = "".join(part if isinstance(part, str) else part.decode(errors="replace")
                             for part in (stdout, stderr) if part)
            _timed_out(shlex.join(map(str, command)), seconds, ci_seconds, output[-6000:])
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def wait(event: threading.Event, what: str, ci_seconds: float = 1.0) -> None:
    """``event.wait()`` under a hang catch; ``what`` names what sets it."""
    seconds = bound(ci_seconds)
    if not event.wait(seconds):
        _timed_out(what, seconds, ci_seconds)


def get(source: Any, what: str, ci_seconds: float = 1.0) -> Any:
    """``source.get()`` (a queue, or a multiprocessing queue) under a hang catch."""
    seconds = bound(ci_seconds)
    try:
        return source.get(timeout=seconds)
    except queue.Empty:
        _timed_out(what, seconds, ci_seconds)


def join(thread: threading.Thread, what: str, ci_seconds: float = 1.0) -> None:
    """``thread.join()`` under a hang catch."""
    seconds = bound(ci_seconds)
    thread.join(seconds)
    if thread.is_alive():
        _timed_out(what, seconds, ci_seconds)


def returns(call: Callable[[], object], what: str, ci_seconds: float = 1.0) -> None:
    """Fail unless ``call()`` returns: it runs on a thread of its own, which a
    call that blocks for ever leaves behind (a daemon). What it raises is
    raised here."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    join(thread, what, ci_seconds)
    if raised:
        raise raised[0]
