"""GET /version and the app's title page name llmctl's version, also from a source tree that was
never installed (the GPU check on a lent machine runs the tree from the import path): the server
once failed to start there with PackageNotFoundError."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError
from pathlib import Path

from llmctl.engine.entrypoints.openai import api_server

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_installed_version_is_named():
    assert api_server.llmctl_version() == api_server.version("llmctl")


def test_a_tree_never_installed_names_pyprojects_version(monkeypatch):
    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(api_server, "version", not_installed)
    declared = re.search(r'^version = "([^"]+)"', PYPROJECT.read_text(), re.MULTILINE).group(1)
    assert api_server.llmctl_version() == f"{declared}+source"
