"""tests/run_tiers.py (`make test`) stopped by SIGTERM, as a CI job's timeout stops it, when it was
started in the background (SIGINT ignored, as `make test &` and nohup leave it): both pytest
processes stop and tear down, nothing is left, and it returns 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import live_pids

ROOT = Path(__file__).resolve().parents[2]

WAITING_TEST = """
import pathlib, time

def test_waits_until_interrupted():
    pathlib.Path({started!r}).touch()
    while True:
        time.sleep(0.05)
"""


def _background() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `cmd &` does to a non-interactive job


def test_sigterm_stops_a_background_run_and_both_tiers(tmp_path):
    started = tmp_path / "started"
    (tmp_path / "waiting_check.py").write_text(WAITING_TEST.format(started=str(started)))
    runner = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "run_tiers.py"),
            str(tmp_path / "waiting_check.py"),
            "-p",
            "no:cacheprovider",
        ],  # fmt: skip
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_background,
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert runner.poll() is None, runner.stdout.read()
            assert time.monotonic() < deadline, "the test never started"
            time.sleep(0.05)
        runner.send_signal(signal.SIGTERM)
        out, _ = runner.communicate(timeout=120)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
    assert runner.returncode == 130, out
    assert "KeyboardInterrupt" in out and "the cluster tier (tests/e2e/cluster)" in out, out
    assert not live_pids(session=runner.pid)  # neither pytest is left
