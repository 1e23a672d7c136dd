"""engine/envs.py: every LLMCTL_* knob declared once, read through it, and refused by name when
its value does not parse."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmctl.engine import envs
from llmctl.engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [p for d in ("engine", "cli", "cluster") for p in (ROOT / d).rglob("*.py")]
# Names that are not environment variables of ours: a C macro of the kernels' builds, and a
# Docker build argument of the image (templates/Dockerfile).
NOT_KNOBS = {"LLMCTL_OP_NAMESPACE", "LLMCTL_EXTRAS"}


def test_no_module_but_envs_reads_an_llmctl_variable_from_the_environment():
    readers = []
    for path in PRODUCT:
        if path.name == "envs.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(environ|getenv).*LLMCTL_|LLMCTL_\w+.*environ", line):
                readers.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert readers == []


def test_every_llmctl_variable_named_in_the_code_is_declared():
    named = set()
    for path in PRODUCT:
        named |= set(re.findall(r"\bLLMCTL_[A-Z][A-Z0-9_]*", path.read_text()))
    assert named - NOT_KNOBS - set(envs.VARIABLES) == set()


def test_defaults_and_values_are_read_when_asked(monkeypatch):
    monkeypatch.delenv("LLMCTL_SHM_SLOT_BYTES", raising=False)
    monkeypatch.delenv("LLMCTL_FUSED_DECODE", raising=False)
    assert envs.LLMCTL_SHM_SLOT_BYTES == 8 << 20
    assert envs.LLMCTL_FUSED_DECODE is True
    monkeypatch.setenv("LLMCTL_SHM_SLOT_BYTES", "4096")
    monkeypatch.setenv("LLMCTL_FUSED_DECODE", "off")
    assert envs.LLMCTL_SHM_SLOT_BYTES == 4096
    assert envs.LLMCTL_FUSED_DECODE is False


@pytest.mark.parametrize(
    "name, value, accepts",
    [
        ("LLMCTL_FUSED_DECODE", "maybe", "0 or 1"),
        ("LLMCTL_ATTENTION_BACKEND", "flash", "auto, torch or triton"),
        ("LLMCTL_WORKER_START_TIMEOUT", "-5", "a positive number of seconds"),
    ],
)
def test_a_value_that_does_not_parse_is_refused_by_name(monkeypatch, name, value, accepts):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        getattr(envs, name)
    assert err.value.message == f"{name}={value!r} is not {accepts}"
    assert name in err.value.hint


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError):
        envs.LLMCTL_NO_SUCH_KNOB  # noqa: B018


def test_the_docs_table_is_the_declarations():
    text = (ROOT / "docs" / "serving.md").read_text()
    begin, end = "<!-- envs.describe() begin -->\n", "\n<!-- envs.describe() end -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == envs.markdown_table(), (
        "regenerate it: python -c 'from llmctl.engine import envs; print(envs.markdown_table())'"
    )
