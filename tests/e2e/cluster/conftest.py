"""The test bed of real hosts: four network namespaces on a bridge, each with its own sshd and
/srv/llmctl; llm-n1..3 run their own Docker daemon, llm-n4 has none."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from testbed import Testbed, ensure_packages, require_root

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    reason = require_root()
    if reason:
        pytest.skip(reason)
    ensure_packages()
    with Testbed(hosts=4, docker=[True, True, True, False]) as bed:
        yield bed


@pytest.fixture(scope="session")
def llmctl_image(testbed: Testbed) -> str:
    """The llmctl image, built by `llmctl image build` on the root daemon (skipped when its
    sources have not changed: the root daemon's data root is kept between runs) and loaded on
    every Docker host."""
    tag = "llmctl:e2e"
    llmctl = Path(sys.executable).parent / "llmctl"
    argv = [str(llmctl), "image", "build", "--debootstrap", "--tag", tag]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    print(f"testbed: {' '.join(argv[1:])}: {result.stdout.strip()}")
    if result.returncode != 0:
        raise AssertionError(f"llmctl image build failed:\n{result.stdout}\n{result.stderr}")
    testbed.load_image(tag)
    return tag


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The environment `llmctl` runs in: its own known_hosts file, wide plain output."""
    known = tmp_path_factory.mktemp("ssh") / "known_hosts"
    return {**os.environ, "LLMCTL_KNOWN_HOSTS": str(known), "COLUMNS": "250", "NO_COLOR": "1"}
