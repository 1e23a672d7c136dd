"""CLI fixtures: invoke `llmctl` in-process with Typer's CliRunner, stdout and stderr apart."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app


@pytest.fixture
def invoke():
    """invoke(*args, env=None) -> click Result; exceptions other than SystemExit propagate, so a
    crash fails the test instead of passing for an error exit."""
    runner = CliRunner()

    def run(*args: str, env: dict[str, str] | None = None):
        return runner.invoke(app, list(args), env=env, catch_exceptions=False)

    return run


@pytest.fixture(autouse=True)
def _restore_llmctl_logger():
    # The CLI configures the "llmctl" logger; leave it as other test tiers expect it.
    logger = logging.getLogger("llmctl")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return str(tiny_models.path("llama"))


@pytest.fixture(scope="session")
def reference_llm(tiny_llama):
    """The library API on the same checkpoint: the oracle for what the CLI prints."""
    from llmctl.engine import LLM

    llm = LLM(tiny_llama, use_tqdm_on_load=False, kv_cache_space_gib=0.01)
    yield llm
    llm.shutdown()
