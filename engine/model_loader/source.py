"""Where a model's files are: resolve what the user named into a local Hugging Face directory.

Accepted: a directory with config.json; a .gguf file (or a directory holding one), converted once
into a cached Hugging Face directory; a hub id such as `facebook/opt-13b` that is already in the
local Hugging Face cache; nothing, for the bundled SmolLM2. llmctl never downloads at run time.
With load_format "dummy" (random weights, model_loader/dummy.py) a directory needs no weights,
and a catalog name (engine/config/model_catalog.py, e.g. Llama-3.1-8B) is a directory llmctl
writes its config.json into.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.engine.config.hf_config_view import HFConfigView
from llmctl.engine.errors import ModelLoadError, ModelNotFoundError
from llmctl.engine.model_loader.default_model import DEFAULT_MODEL_NAME, default_model_path

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_NAME_HINT = (
    "name a local Hugging Face directory (with config.json and weights), a .gguf file, or a hub "
    "id already in the local Hugging Face cache; llmctl never downloads models"
)


@dataclass(frozen=True)
class ModelSource:
    path: str  # a local Hugging Face directory
    display_name: str
    gguf_file: str | None = None  # the GGUF file it was converted from

    def load_hf_config(self) -> Any:
        """The model's Hugging Face config. Importing transformers for AutoConfig costs ~2 s and
        ~200 MB at start-up (~4 s of CPU on a busy 2-core machine), so what AutoConfig read is
        kept as an HFConfigView: for a GGUF file's directory (written by llmctl) next to its
        config.json; for any other directory in llmctl's cache, under a digest of config.json's
        bytes and the transformers version that read them (a changed file, or another
        transformers, is read again)."""
        if self.gguf_file is not None:
            view_file: Path | None = Path(self.path, CONFIG_VIEW_FILE)
        else:
            view_file = _cached_view_file(self.path)
        if view_file is not None and view_file.is_file():
            try:
                return HFConfigView.from_json(view_file.read_text())
            except (OSError, ValueError, KeyError, AttributeError):
                pass  # unreadable: read config.json again below, and rewrite the view
        from transformers import AutoConfig

        try:
            config = _builtin_config(self.path) or AutoConfig.from_pretrained(
                self.path, local_files_only=True
            )
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            raise ModelLoadError(
                f"cannot read {os.path.join(self.path, 'config.json')}: {exc}",
                "check that the file is a complete Hugging Face config.json",
            ) from exc
        if view_file is not None:
            write_config_view(config, view_file.parent, view_file.name)
        return config

    def architecture(self, hf_config: Any) -> str:
        archs = getattr(hf_config, "architectures", None) or []
        if archs:
            return archs[0]
        raise ModelLoadError(
            f"{self.path}/config.json names no architectures",
            'add "architectures": ["LlamaForCausalLM"] (or the right class) to config.json',
        )


CONFIG_VIEW_FILE = "llmctl_config_view.json"


def write_config_view(config: Any, directory: Path, name: str = CONFIG_VIEW_FILE) -> None:
    """Save `config`'s HFConfigView into `directory` (atomically: ranks may read it meanwhile)."""
    tmp = directory / f".{name}.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(HFConfigView.of(config).to_json())
        os.replace(tmp, directory / name)
    except OSError:  # a read-only cache: the view is an optimisation only
        tmp.unlink(missing_ok=True)


def _cached_view_file(path: str) -> Path | None:
    """Where the HFConfigView of `path`'s config.json is cached (None: no readable config.json,
    or no transformers installed to read it)."""
    from importlib import metadata

    from llmctl.engine.model_loader.gguf import cache_root

    try:
        data = Path(path, "config.json").read_bytes()
        version = metadata.version("transformers")
    except (OSError, metadata.PackageNotFoundError):
        return None
    # "view-2": what HFConfigView.of keeps; a change to it names a new version here
    digest = hashlib.sha256(data + f"\0transformers {version}\0view-2".encode()).hexdigest()[:24]
    return cache_root().parent / "config-views" / f"{digest}.json"


def resolve_model(model: str | None, progress=None, load_format: str = "auto") -> ModelSource:
    """Where `model`'s files are. load_format "dummy" reads no weights: a directory may lack
    them, and a catalog name resolves to a directory holding the entry's config.json."""
    dummy = load_format == "dummy"
    if model is None or model == "":
        gguf_path = default_model_path()
        return _from_gguf(gguf_path, DEFAULT_MODEL_NAME, progress)
    path = Path(os.path.expanduser(model))
    if path.is_file():
        if path.suffix == ".gguf":
            return _from_gguf(path, path.stem, progress)
        raise ModelNotFoundError(f"{model} is a file but not a .gguf file", _NAME_HINT)
    if path.is_dir():
        if (path / "config.json").is_file():
            if not dummy:
                _check_weights(path)
            return ModelSource(path=str(path.resolve()), display_name=model)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], model, progress)
        if len(ggufs) > 1:
            raise ModelNotFoundError(
                f"{model} holds several .gguf files: {', '.join(g.name for g in ggufs)}",
                "name the .gguf file to load",
            )
        raise ModelNotFoundError(f"{model} has no config.json and no .gguf file", _NAME_HINT)
    cached = _from_hf_cache(model, check_weights=not dummy)
    if cached is not None:
        return cached
    if dummy:
        from llmctl.engine.config.model_catalog import find_in_catalog

        entry = find_in_catalog(model)
        if entry is not None:
            return ModelSource(path=str(_catalog_dir(entry)), display_name=entry.name)
        raise ModelNotFoundError(
            f"model {model!r} not found, nor is it a catalog name",
            "name a directory with a config.json, or a catalog name (`llmctl plan "
            "--list-models`), such as Llama-3.1-8B",
        )
    raise ModelNotFoundError(f"model {model!r} not found", _NAME_HINT)


def _catalog_dir(entry) -> Path:
    """A directory holding the catalog entry's config.json (written once, atomically)."""
    from llmctl.engine.model_loader.gguf import cache_root

    directory = cache_root().parent / "catalog" / entry.name
    text = json.dumps(entry.config_json(), indent=2, sort_keys=True)
    config = directory / "config.json"
    if not config.is_file() or config.read_text() != text:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".config.json.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, config)
    return directory


def has_tokenizer_files(path: str) -> bool:
    """The directory holds a tokenizer (a fast tokenizer's JSON, or vocab files)."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    return any(os.path.isfile(os.path.join(path, name)) for name in names)


def _from_gguf(path: Path, name: str, progress) -> ModelSource:
    from llmctl.engine.model_loader.gguf import ensure_converted

    directory = ensure_converted(path, progress)
    return ModelSource(path=str(directory), display_name=name, gguf_file=str(path))


def _check_weights(path: Path) -> None:
    if any((path / f).is_file() for f in _WEIGHT_FILES) or any(path.glob("*.safetensors")):
        return
    raise ModelLoadError(
        f"{path} has a config.json but no weights (model.safetensors, an index, "
        "or pytorch_model.bin)",
        "copy the weight files next to config.json",
    )


def _from_hf_cache(repo_id: str, check_weights: bool = True) -> ModelSource | None:
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        directory = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    if check_weights:
        _check_weights(Path(directory))
    return ModelSource(path=directory, display_name=repo_id)


# model_type -> the transformers config that reads it: checkpoints whose config.json names a
# model_type with custom code (auto_map) for a config transformers has under another name.
# AutoConfig would ask to trust that code (and prompt on a terminal).
BUILTIN_CONFIGS = {"kimi_k2": "deepseek_v3"}  # Kimi-K2 is DeepseekV3ForCausalLM


def _builtin_config(path: str) -> Any | None:
    """The config of a BUILTIN_CONFIGS checkpoint, read by transformers' own class; else None."""
    config_file = Path(path, "config.json")
    if not config_file.is_file():
        return None
    values = json.loads(config_file.read_text())
    model_type = values.get("model_type")
    if model_type not in BUILTIN_CONFIGS:
        return None
    from transformers import AutoConfig

    values = {k: v for k, v in values.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(BUILTIN_CONFIGS[model_type], **values)
