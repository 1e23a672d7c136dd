"""The test bed made ready in the background while the other tiers run.

Building the llmctl image (debootstrap, the wheels, `docker build`) and loading it into three
Docker daemons took 7 to 8 minutes before the first cluster test on a fresh 2-core machine
(about 400 CPU-seconds, most of them the Docker daemons', plus waits on the disk and the
network). So when collection ends with cluster tests selected, the hosts start and a helper
process (testbed_image.py) builds, saves and loads the image (and the one without Ray the
mp-backend tests serve), all at the lowest CPU priority
(threads, sessions and Docker's containers: see set_priority): they take what the other tiers
leave idle. The cluster tests run last (conftest.py); their first fixture waits for the helper
and then gives the hosts' daemons normal priority again.

The helper is one child of the test session from the start to the cluster tier (it waits for
its stdin to close), so tests that count the session's children see the same set throughout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from testbed import Testbed, ensure_packages, require_root
from testbed_os import set_priority

HERE = Path(__file__).parent
LOWEST = 19  # nice value while the image is prepared


class Preparation:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.bed: Testbed | None = None
        self.skip_reason: str | None = None
        self.error: BaseException | None = None
        self.helper: subprocess.Popen | None = None
        self.result: dict | None = None
        self.started = False

    def start(self) -> None:
        """Start the hosts and the helper; returns at once (errors are kept for the fixtures)."""
        if self.started:
            return
        self.started = True
        self.skip_reason = require_root()
        if self.skip_reason:
            return
        # Linux keeps a nice value per thread; what this thread starts inherits it: the hosts'
        # daemons (dockerd does the build and the loads) and the helper.
        thread = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, LOWEST)
        try:
            ensure_packages()
            self.bed = Testbed(hosts=4, docker=[True, True, True, False])
            self.bed.start()
            sockets = [h.docker_host for h in self.bed.docker_hosts]
            self.helper = subprocess.Popen(
                [sys.executable, str(HERE / "testbed_image.py"), self.tag, str(self.bed.root)]
                + sockets,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # stopped as a group: the build's processes with it
            )
            # Each daemon and the helper lead their own session: set those sessions' priority.
            set_priority([*self.bed.process_ids(), self.helper.pid], LOWEST)
        except BaseException as e:  # noqa: BLE001 - raised by the fixture that needs the bed
            self.error = e
        finally:
            os.setpriority(os.PRIO_PROCESS, thread, before)

    def testbed(self) -> Testbed:
        """The started bed, once the image work is over (the tests stop and start daemons)."""
        if not self.started:
            self.start()
        if self.skip_reason:
            import pytest

            pytest.skip(self.skip_reason)
        if self.error is not None:
            raise self.error
        assert self.bed is not None
        if self.result is None:
            self.result = self._wait_for_helper()
            for line in self.result["log"]:
                print(line)
            self._restore_priority()
        return self.bed

    def image(self) -> str:
        self.testbed()
        assert self.result is not None
        if not self.result["ok"]:
            raise AssertionError(self.result["error"])
        return self.tag

    def _wait_for_helper(self) -> dict:
        assert self.helper is not None and self.helper.stdout is not None
        line = self.helper.stdout.readline()
        self.helper.stdin.close()
        code = self.helper.wait(60)
        if not line:
            return {"ok": False, "log": [], "error": f"testbed_image.py exited with {code}"}
        return json.loads(line)

    def _restore_priority(self) -> None:
        if self.bed is not None:
            set_priority(self.bed.process_ids(), 0)

    def close(self) -> None:
        """Stop the helper (if still at work) and the bed. Safe to call twice."""
        helper, self.helper = self.helper, None
        if helper is not None and helper.poll() is None:
            _signal_group(helper.pid, signal.SIGTERM)
            try:
                helper.wait(30)
            except subprocess.TimeoutExpired:
                _signal_group(helper.pid, signal.SIGKILL)
                helper.wait(10)
        self._restore_priority()  # Docker's containers' cgroup too, if the helper never ended
        bed, self.bed = self.bed, None
        if bed is not None:
            bed.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
