"""ModelSpec: a model's shape, from a config.json, a GGUF file's metadata or the catalog, and the
parameter count each rank of a layout holds. Pure: no torch, no transformers.

Weights are counted the way the engine's layers hold them: column-parallel matrices split by the
head and column partitions of `engine/distributed/partition.py` (uneven when tp does not divide),
row-parallel matrices split by their inputs (their bias whole on every rank), norms replicated,
the vocabulary split for the embedding (first stage) and the LM head (last stage; a tied head on a
stage without the embedding holds its own copy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmctl.cluster.errors import UnknownModelError
from llmctl.engine.distributed.partition import HeadShard, head_shards, split_evenly

_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
    "OPTForCausalLM": "opt",
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str = "bfloat16"  # the checkpoint's
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0  # mixture of experts (Mixtral): MLPs per layer
    word_embed_proj_dim: int | None = None  # OPT's embedding width when it differs

    @property
    def family(self) -> str:
        return _FAMILIES[self.architecture]

    # -- parameters --------------------------------------------------------------------------

    def layer_params(self, tp_rank: int = 0, tp: int = 1) -> int:
        """Parameters of one decoder layer on `tp_rank` of `tp` ranks."""
        h, d = self.hidden_size, self.head_dim
        shard: HeadShard = head_shards(self.num_heads, self.num_kv_heads, tp)[tp_rank]
        inter = split_evenly(self.intermediate_size, tp)[tp_rank]
        q, kv = shard.num_q_heads * d, shard.num_kv_heads * d
        if self.family == "llama":
            attn = h * (q + 2 * kv) + q * h
            attn += (q + 2 * kv) if self.qkv_bias else 0
            attn += h if self.o_bias else 0
            mlp = 3 * h * inter + (2 * inter + h if self.mlp_bias else 0)
            if self.num_experts:
                mlp = self.num_experts * 3 * h * inter + h * self.num_experts  # experts + router
            return attn + mlp + 2 * h  # two RMSNorms
        # GPT-2 and OPT: q, k, v and the output projection with biases, a two-matrix MLP with
        # biases, two LayerNorms (weight and bias).
        attn = h * 3 * q + 3 * q + q * h + h
        mlp = h * inter + inter + inter * h + h
        return attn + mlp + 4 * h

    def embedding_params(self, tp_rank: int = 0, tp: int = 1) -> int:
        """The first stage's embeddings (token, positions, OPT's project_in)."""
        vocab = split_evenly(self.vocab_size, tp)[tp_rank]
        width = self.word_embed_proj_dim or self.hidden_size
        params = vocab * width
        if self.family == "gpt2":
            params += self.max_position_embeddings * self.hidden_size
        if self.family == "opt":
            params += (self.max_position_embeddings + 2) * self.hidden_size
            if width != self.hidden_size:
                params += width * self.hidden_size
        return params

    def head_params(self, tp_rank: int = 0, tp: int = 1, with_embedding: bool = True) -> int:
        """The last stage's final norm and LM head (shared with the embedding when tied and on
        the same stage)."""
        width = self.word_embed_proj_dim or self.hidden_size
        norm = self.hidden_size if self.family == "llama" else 2 * self.hidden_size
        if self.family == "opt" and width != self.hidden_size:
            norm = width * self.hidden_size  # project_out (opt-350m drops the final norm)
        lm_head = split_evenly(self.vocab_size, tp)[tp_rank] * width
        if self.tie_word_embeddings and with_embedding:
            lm_head = 0
        return norm + lm_head

    def total_params(self) -> int:
        return (
            self.num_layers * self.layer_params()
            + self.embedding_params()
            + self.head_params(with_embedding=True)
        )

    def kv_bytes_per_token(self, layers: int, tp_rank: int, tp: int, kv_dtype_bytes: int) -> int:
        """K and V of one token across `layers` layers on one tensor-parallel rank."""
        shard = head_shards(self.num_heads, self.num_kv_heads, tp)[tp_rank]
        return 2 * layers * shard.num_kv_heads * self.head_dim * kv_dtype_bytes

    # -- reading configs -----------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict, name: str) -> ModelSpec:
        archs = config.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_TYPE.get(config.get("model_type", ""), "")
        if arch not in _FAMILIES:
            raise UnknownModelError(
                f"{name}: architecture {arch or config.get('model_type')!r} cannot be planned",
                f"planning knows {', '.join(sorted(_FAMILIES))}",
            )
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        if arch == "GPT2LMHeadModel":
            hidden, heads = config["n_embd"], config["n_head"]
            return cls(
                name=name,
                architecture=arch,
                num_layers=config["n_layer"],
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=config.get("n_inner") or 4 * hidden,
                vocab_size=config["vocab_size"],
                max_position_embeddings=config.get("n_positions", 1024),
                tie_word_embeddings=True,
                dtype=dtype,
            )
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        if arch == "OPTForCausalLM":
            return cls(
                name=name,
                architecture=arch,
                num_layers=config["num_hidden_layers"],
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=config["ffn_dim"],
                vocab_size=config["vocab_size"],
                max_position_embeddings=config.get("max_position_embeddings", 2048),
                tie_word_embeddings=config.get("tie_word_embeddings", True),
                dtype=dtype,
                word_embed_proj_dim=config.get("word_embed_proj_dim"),
            )
        return cls(
            name=name,
            architecture=arch,
            num_layers=config["num_hidden_layers"],
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype=dtype,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
            o_bias=bool(config.get("attention_bias")),
            mlp_bias=bool(config.get("mlp_bias")),
            num_experts=config.get("num_local_experts", 0) if arch == "MixtralForCausalLM" else 0,
        )


_ARCH_BY_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "opt": "OPTForCausalLM",
}

# GGUF metadata key (after the "<arch>." prefix) -> Hugging Face config key.
_GGUF_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "expert_count": "num_local_experts",
}


def load_model_spec(model: str | None) -> ModelSpec:
    """A catalog name, a Hugging Face directory, a .gguf file, or None (the bundled default)."""
    from llmctl.cluster.catalog import CATALOG, find_in_catalog

    if model is None:
        from llmctl.engine.model_loader.default_model import DEFAULT_MODEL_NAME

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
        return _from_gguf(gguf_file, model)
    spec = find_in_catalog(model)
    if spec is not None:
        return spec
    raise UnknownModelError(
        f"{model!r} is not a local model directory, a .gguf file, or a catalog name",
        "run `llmctl plan --list-models` for the catalog, or give a path",
    )


def _from_gguf(path: Path, name: str) -> ModelSpec:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    config: dict = {"model_type": arch}
    for key, field in reader.fields.items():
        prefix, _, rest = key.partition(".")
        if prefix == arch and rest in _GGUF_KEYS:
            config[_GGUF_KEYS[rest]] = int(field.contents())
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in reader.fields:
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    config["torch_dtype"] = "float32"  # dequantized by the engine
    return ModelSpec.from_config(config, name)
