"""Typed errors of planning and cluster operations (LLMCtlError: a message and a hint)."""

from __future__ import annotations

from llmctl.engine.errors import ConfigError, LLMCtlError


class InventoryError(ConfigError):
    """The inventory file (or the flags standing for it) is malformed or impossible."""


class PlanError(LLMCtlError):
    """No layout of this inventory holds the model; the message says how much memory is missing."""


class UnknownModelError(ConfigError):
    """The model is neither a local directory or GGUF file, nor in the catalog."""
