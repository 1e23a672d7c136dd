"""ModelSpec: a model to plan for: its name, its checkpoint's dtype and its ModelShape (from a
config.json, a GGUF file's metadata or the catalog). Pure: no torch, no transformers.

The shape and the parameter count each rank of a layout holds come from
`engine/config/model_shape.py`, the same ModelShape the engine builds its layers from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmctl.cluster.errors import UnknownModelError
from llmctl.cluster.plan.weight_format import WeightFormats, dense_format, gguf_weight_formats
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    shape: ModelShape
    dtype: str = "bfloat16"  # the checkpoint's
    # A GGUF file's tensor types (its float tensors under `dtype`); None: all in `dtype`.
    weight_formats: WeightFormats | None = None

    @property
    def prequantized(self) -> bool:
        """The checkpoint's weights are already quantized (a GGUF of Q4_1, Q8_0, ... blocks)."""
        return self.weight_formats is not None and self.weight_formats.quantized

    # The shape's sizes under the names the planner prints.
    @property
    def architecture(self) -> str:
        return self.shape.architecture

    @property
    def family(self) -> str:
        return self.shape.family

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def num_heads(self) -> int:
        return self.shape.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.shape.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def intermediate_size(self) -> int:
        return self.shape.intermediate_size

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.shape.max_position_embeddings

    @property
    def tie_word_embeddings(self) -> bool:
        return self.shape.tie_word_embeddings

    @property
    def num_experts(self) -> int:
        return self.shape.num_experts

    def total_params(self) -> int:
        return self.shape.total_params()

    def embedding_params(self, tp_rank: int = 0, tp: int = 1) -> int:
        return self.shape.embedding_params(tp_rank, tp)

    def head_params(self, tp_rank: int = 0, tp: int = 1, with_embedding: bool = True) -> int:
        return self.shape.head_params(tp_rank, tp, with_embedding)

    # -- reading configs -----------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict, name: str) -> ModelSpec:
        """From a config.json (a block-FP8 checkpoint's quantization_config included)."""
        from llmctl.engine.errors import UnsupportedQuantizationError
        from llmctl.engine.layers.quantization.quant_config import QuantizationConfig

        try:
            shape = ModelShape.from_hf_config(config)
            quant = QuantizationConfig.for_checkpoint(config)
        except (ConfigError, UnsupportedQuantizationError) as exc:
            message = f"{name}: {exc.message}; it cannot be planned"
            raise UnknownModelError(message, exc.hint) from None
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        formats = None
        if quant is not None:  # FP8: its linear layers as the engine holds them
            formats = WeightFormats.for_fp8_checkpoint(dense_format(dtype, 2))
        return cls(name=name, shape=shape, dtype=dtype, weight_formats=formats)


def load_model_spec(model: str | None) -> ModelSpec:
    """A catalog name, a Hugging Face directory, a .gguf file, or None (the bundled default)."""
    from llmctl.cluster.plan.catalog import CATALOG, find_in_catalog

    if model is None:  # the bundled GGUF as the engine loads it; the catalog's entry without it
        from llmctl.engine.errors import ModelNotFoundError
        from llmctl.engine.model_loader.default_model import DEFAULT_MODEL_NAME, default_model_path

        try:
            return spec_from_gguf(default_model_path(), DEFAULT_MODEL_NAME)
        except ModelNotFoundError:
            return CATALOG[DEFAULT_MODEL_NAME]
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UnknownModelError(f"cannot read {path / 'config.json'}: {exc}") from None
        return ModelSpec.from_config(config, model)
    gguf_file = path if path.suffix == ".gguf" else None
    if path.is_dir() and gguf_file is None:
        found = sorted(path.glob("*.gguf"))
        gguf_file = found[0] if len(found) == 1 else None
    if gguf_file is not None and gguf_file.is_file():
        return spec_from_gguf(gguf_file, model)
    spec = find_in_catalog(model)
    if spec is not None:
        return spec
    raise UnknownModelError(
        f"{model!r} is not a local model directory, a .gguf file, or a catalog name",
        "run `llmctl plan --list-models` for the catalog, or give a path",
    )


def spec_from_gguf(path: str | Path, name: str) -> ModelSpec:
    """The shape from the GGUF's metadata and each tensor's type, read from the file's header
    alone (no tensor data, no tokenizer decoding: milliseconds)."""
    from llmctl.engine.layers.quantization.quant_config import QuantizationConfig
    from llmctl.engine.model_loader.gguf_file import read_gguf_metadata

    metadata, types = read_gguf_metadata(path)
    try:
        shape = ModelShape.from_gguf_metadata(metadata, tuple(n for n, _ in types))
    except ConfigError as exc:
        raise UnknownModelError(f"{name}: {exc.message}; it cannot be planned", exc.hint) from None
    QuantizationConfig.for_gguf([type_name for _, type_name in types])  # types the engine reads
    arch = str(metadata.get("general.architecture", ""))
    formats = gguf_weight_formats(dense_format("float32", 4), types, arch)
    return ModelSpec(name=name, shape=shape, dtype="float32", weight_formats=formats)
