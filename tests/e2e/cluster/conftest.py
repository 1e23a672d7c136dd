"""The test bed of real hosts: four network namespaces on a bridge, each with its own sshd and
/srv/llmctl; llm-n1..3 run their own Docker daemon, llm-n4 has none.

These tests are marked `cluster` and run last: the bed and its image are prepared in the
background from the end of collection on (testbed_prep.py), while the other tiers run.
`pytest -m "not cluster"` runs everything else, without root. `make test` runs the two in two
processes side by side (tests/run_tiers.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testbed import Testbed
from testbed_prep import Preparation

HERE = Path(__file__).parent
PREPARATION = Preparation("llmctl:e2e")


def _in_cluster_tier(item: pytest.Item) -> bool:
    return item.path.is_relative_to(HERE)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    cluster = [item for item in items if _in_cluster_tier(item)]
    for item in cluster:
        item.add_marker(pytest.mark.cluster)
    items[:] = [item for item in items if not _in_cluster_tier(item)] + cluster


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(_in_cluster_tier(item) for item in session.items):
        PREPARATION.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    PREPARATION.close()


def pytest_terminal_summary(terminalreporter) -> None:
    """What the image's preparation did and how long each step took (the builds, the save, the
    loads), in the summary: with the other tiers beside it, it decides when this tier starts."""
    result = PREPARATION.result
    if result is not None and result["log"]:
        terminalreporter.section("the test bed's image")
        for line in result["log"]:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def testbed() -> Testbed:
    """The started bed (skipped without root); stopped when the session ends."""
    return PREPARATION.testbed()


@pytest.fixture(scope="session")
def llmctl_image(testbed: Testbed) -> str:
    """The llmctl image, built by `llmctl image build --debootstrap` on the root daemon (skipped
    when its sources have not changed: the root daemon's data root is kept between runs) and
    loaded on every Docker host."""
    return PREPARATION.image()


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The environment `llmctl` runs in: its own known_hosts file, wide plain output."""
    known = tmp_path_factory.mktemp("ssh") / "known_hosts"
    return {**os.environ, "LLMCTL_KNOWN_HOSTS": str(known), "COLUMNS": "250", "NO_COLOR": "1"}
