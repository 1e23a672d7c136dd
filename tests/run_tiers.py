"""The whole suite as `make test` runs it: the cluster tier beside the others, in two pytest
processes.

The cluster tier (tests/e2e/cluster, marked `cluster`) spends most of its time waiting: on sshd,
on Docker daemons, on containers and the servers inside them, in network namespaces of its own.
Run one after the other, the tiers kept about one of this machine's 2 cores busy; side by side
each fills the other's idle time (the times of both ways: docs/testing.md).

The other tiers' output comes as they run; the cluster tier's is kept in a file and printed after
them (it says where while it runs). The exit status is the other tiers' when they failed, else the
cluster tier's (130 after a Ctrl-C or SIGTERM, once both have stopped and torn their fixtures
down). Extra arguments (paths, -k, -x ...) go to both pytest processes; one that they
leave without a test (pytest's exit status 5) does not fail the run unless both are. `pytest`
alone still runs every tier in one process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
INTERRUPTED = 130  # a shell's status for a command a SIGINT ended


def _pytest(marker: str, extra: list[str], **kwargs) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pytest", "-q", "-m", marker, *extra]
    return subprocess.Popen(argv, cwd=ROOT, preexec_fn=_sigint_default, **kwargs)


def _sigint_default() -> None:
    """A suite started in the background (`make test &`, nohup, a CI job) inherits SIGINT
    ignored, and a Python started so installs no KeyboardInterrupt handler: the SIGINT that
    stops pytest below would be lost, and the run would go on to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(process: subprocess.Popen) -> None:
    """pytest stops at SIGINT and still tears its fixtures down (the test bed's hosts); a second
    one during the teardown would cut it short."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)


def main(extra: list[str]) -> int:
    with tempfile.NamedTemporaryFile("w+", prefix="llmctl-cluster-tier-", suffix=".log") as log:
        # Its own process group: a Ctrl-C in the terminal reaches it once, from us (below). The
        # other tiers stay in the terminal's group and get a Ctrl-C as plain pytest would.
        cluster = _pytest("cluster", extra, stdout=log, stderr=subprocess.STDOUT, process_group=0)
        print(f"The cluster tier runs beside the others; its output: {log.name}", flush=True)
        others = _pytest("not cluster", extra)

        def stop(signum, frame):  # SIGTERM (a CI job's timeout): both stop as at a Ctrl-C
            _interrupt(others)
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        interrupted = False
        try:
            others.wait()
            if cluster.poll() is None:
                print(f"\nWaiting for the cluster tier ({log.name}) ...", flush=True)
            cluster.wait()
        except KeyboardInterrupt:
            interrupted = True
            _interrupt(cluster)
            others.wait()
            cluster.wait()
        log.seek(0)
        print("\n=============== the cluster tier (tests/e2e/cluster) ===============", flush=True)
        sys.stdout.write(log.read())
        sys.stdout.flush()
    if interrupted:
        return INTERRUPTED
    codes = (others.returncode, cluster.returncode)
    if NO_TESTS in codes and codes != (NO_TESTS, NO_TESTS):
        codes = tuple(0 if c == NO_TESTS else c for c in codes)
    return codes[0] or codes[1]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
