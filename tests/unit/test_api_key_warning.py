"""`llmctl serve` beyond this machine without an API key says so, naming the flag."""

from __future__ import annotations

import logging

import pytest

from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.entrypoints.openai.server_config import ServerConfig
from llmctl.engine.errors import LLMCtlError


@pytest.mark.parametrize(
    "host, api_key, warned",
    [
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
        ("0.0.0.0", None, True),
        ("10.0.0.5", None, True),
        ("node-1.example", None, True),  # a name may resolve to any address
        ("0.0.0.0", "s3cret", False),
    ],
)
def test_serving_beyond_loopback_without_an_api_key_is_warned_naming_the_flag(
    host, api_key, warned
):
    warning = ServerConfig(host=host, port=8000, api_key=api_key).api_key_warning()
    if not warned:
        assert warning is None
        return
    assert warning.startswith(f"Serving on {host}:8000 without an API key: anyone who reaches")
    assert "pass --api-key KEY (or set LLMCTL_API_KEY)" in warning


def test_the_server_logs_it_before_it_loads_the_model(caplog, tmp_path):
    from llmctl.engine.entrypoints.openai.api_server import run_server

    with caplog.at_level(logging.WARNING, "llmctl"), pytest.raises(LLMCtlError):
        run_server(EngineArgs(model=str(tmp_path / "no-model")), ServerConfig(host="0.0.0.0"))
    assert any("without an API key" in r.getMessage() for r in caplog.records)
