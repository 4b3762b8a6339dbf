"""The tests' hang catches (tests/hangs.py): a wait that runs out fails as a
timeout naming what hung, and a subprocess's children die with it."""

from __future__ import annotations

import os
import sys
import threading
import time

import hangs
import pytest


@pytest.fixture
def short(monkeypatch):
    """Bounds of half a second, so that the hangs here end quickly."""
    monkeypatch.setattr(hangs, "FLOOR_SECONDS", 0.5)
    monkeypatch.setattr(hangs, "FACTOR", 1)


def test_a_bound_is_ten_times_the_ci_time_and_at_least_two_minutes():
    assert hangs.bound(1) == 120 and hangs.bound(40) == 400


def test_a_subprocess_that_hangs_fails_as_a_timeout_and_its_children_are_killed(short, tmp_path):
    pid_file = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        hangs.run([sys.executable, "-c", hang], ci_seconds=0.1, capture_output=True, text=True)
    message = str(failed.value)
    assert message.startswith("timeout (a hang catch, not a speed check): ") and "did not finish in 0.5 s" in message
    assert f"{sys.executable} -c" in message and "started" in message  # the command, and its output so far
    child = int(pid_file.read_text())
    for _ in range(100):  # the killed grandchild is reaped by init
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the hung command's child {child} outlived the timeout")


def test_a_subprocess_that_finishes_returns_as_subprocess_run_does():
    done = hangs.run([sys.executable, "-c", "print('out')"], ci_seconds=1, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "out\n")


def test_thread_waits_fail_as_timeouts_naming_what_hung(short):
    with pytest.raises(pytest.fail.Exception, match=r"^timeout \(a hang catch, not a speed check\): the gate did not"):
        hangs.wait(threading.Event(), "the gate")
    with pytest.raises(pytest.fail.Exception, match="the blocked call did not finish"):
        hangs.returns(threading.Event().wait, "the blocked call")
