"""ModelShape: a model's sizes, read once from a Hugging Face config or GGUF metadata.

The engine's configs, the layers' head and column partitions, the model files and the planner all
read a model's shape here (pure: no torch, no transformers). Weights per rank are counted the way
the engine's layers hold them, with the partition functions those layers call
(`engine/distributed/partition.py`): column-parallel matrices split by `head_shards` (attention)
and `column_shards` (MLP, vocabulary), uneven when tp does not divide; row-parallel matrices split
by their inputs (their bias whole on every rank); norms replicated; the vocabulary split for the
embedding (first stage) and the LM head (last stage; a tied head on a stage without the embedding
holds its own copy). A mixture of experts counts every expert as FusedMoE holds it: a slice of
each (tensor parallel) or whole experts dealt out over the tp ranks (`expert_parallel`), plus the
replicated router and Qwen2-MoE's shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.engine.config.architectures import (
    ARCHITECTURE_BY_MODEL_TYPE,
    FAMILIES,
    GGUF_ARCHITECTURES,
    GGUF_KEYS,
    MOE_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
)
from llmctl.engine.config.mla_shape import (
    MLA_ARCHITECTURES,
    check_mla_shape,
    mla_attention_params,
    mla_gguf_values,
    mla_hf_config_values,
    mla_shape_values,
)
from llmctl.engine.distributed.partition import (
    HeadShard,
    column_shards,
    expert_shards,
    head_shards,
)
from llmctl.engine.errors import ConfigError

# Hugging Face's names for a layer's attention (config.layer_types).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
GGUF_TOKENS = "tokenizer.ggml.tokens"  # the vocabulary, when no <arch>.vocab_size is given
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048  # for configs that give no length
_POSITIVE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelShape:
    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # MLP features (GPT-2's n_inner, OPT's ffn_dim)
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0  # mixture of experts: routed expert MLPs per layer (0: dense)
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's features (0: intermediate_size, as Mixtral)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (0: none)
    decoder_sparse_step: int = 1  # Qwen MoE: every step-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key
    word_embed_proj_dim: int | None = None  # OPT's embedding width when it differs
    sliding_window: int | None = None  # Mistral/Qwen2: tokens each query sees
    # Multi-head latent attention (DeepSeek-V2/V3, engine/config/mla_shape.py): keys and values
    # come from a compressed latent of kv_lora_rank features plus one shared rope key of
    # qk_rope_head_dim; head_dim is the query/key head (qk_nope_head_dim + qk_rope_head_dim).
    kv_lora_rank: int = 0  # 0: not MLA
    q_lora_rank: int = 0  # 0: queries straight from the hidden state (q_proj)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek / GLM-4.5 mixtures: the first layers dense, a routing bias per expert
    # (e_score_correction_bias, float32), shared experts without Qwen2-MoE's sigmoid gate.
    first_k_dense_replace: int = 0
    expert_score_bias: bool = False
    shared_expert_gate: bool = True  # Qwen2-MoE's shared_expert_gate (with a shared expert)
    # Each layer's attention, FULL_ATTENTION or SLIDING_ATTENTION (Gemma 3, gpt-oss alternate);
    # () : every layer alike, sliding when sliding_window is set.
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax
    moe_bias: bool = False  # gpt-oss: the router and every expert's matrices have biases

    def __post_init__(self) -> None:
        if self.architecture not in FAMILIES:
            raise ConfigError(
                f"architecture {self.architecture!r} has no known shape",
                f"llmctl knows {', '.join(sorted(FAMILIES))}",
            )
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{self.architecture}: {name} must be a positive integer, got {value!r}",
                    "fix the model's config.json (or GGUF metadata)",
                )
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.architecture}: {self.num_attention_heads} attention heads are not a "
                f"multiple of {self.num_kv_heads} KV heads",
                "fix num_key_value_heads in the model's config.json",
            )
        if self.architecture in MLA_ARCHITECTURES:
            check_mla_shape(self)
        if self.layer_types and (
            len(self.layer_types) != self.num_layers
            or not set(self.layer_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}
        ):
            raise ConfigError(
                f"{self.architecture}: layer_types must name {FULL_ATTENTION!r} or "
                f"{SLIDING_ATTENTION!r} for each of the {self.num_layers} layers, got "
                f"{list(self.layer_types)}",
                "fix layer_types in the model's config.json",
            )
        if self.num_experts < 0:
            raise ConfigError(f"num_experts must not be negative, got {self.num_experts}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"{self.architecture}: num_experts_per_tok={self.num_experts_per_tok} is not "
                f"between 1 and the {self.num_experts} experts",
                "fix num_experts_per_tok in the model's config.json",
            )

    @property
    def family(self) -> str:
        return FAMILIES[self.architecture]

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: one latent KV "head" per token (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def embedding_width(self) -> int:
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def expert_intermediate_size(self) -> int:
        """One routed expert's MLP features."""
        return self.moe_intermediate_size or self.intermediate_size

    def layer_sliding_window(self, layer: int) -> int | None:
        """The tokens decoder layer `layer`'s queries see (None: the whole sequence)."""
        if self.layer_types and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (Qwen MoE may keep some dense)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
            and layer >= self.first_k_dense_replace
        )

    def expert_shards(self, ep: int) -> list[int]:
        """Whole experts per expert-parallel rank, dealt out contiguously (8 on 3: [3, 3, 2])."""
        return expert_shards(self.num_experts, ep)

    # -- reading configs -----------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: Any, architecture: str | None = None) -> ModelShape:
        """From a transformers PretrainedConfig, an HFConfigView or config.json as a dict."""
        get = _getter(cfg)
        arch = architecture or _architecture(get)
        if arch == "GPT2LMHeadModel":
            hidden, heads = _first(get, "n_embd", "hidden_size"), _first(get, "n_head")
            heads = heads or get("num_attention_heads")
            return cls(
                architecture=arch,
                num_layers=_first(get, "n_layer", "num_hidden_layers"),
                hidden_size=hidden,
                num_attention_heads=heads,
                num_kv_heads=heads,
                head_dim=_div(hidden, heads),
                intermediate_size=get("n_inner") or 4 * hidden,
                vocab_size=get("vocab_size"),
                max_position_embeddings=_max_positions(get),
                tie_word_embeddings=True,
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
            )
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        if arch in MLA_ARCHITECTURES:
            return cls(architecture=arch, **mla_shape_values(get, arch))
        if arch == "OPTForCausalLM":
            bias = get("enable_bias", True) is not False
            return cls(
                architecture=arch,
                num_layers=get("num_hidden_layers"),
                hidden_size=hidden,
                num_attention_heads=heads,
                num_kv_heads=heads,
                head_dim=_div(hidden, heads),
                intermediate_size=get("ffn_dim"),
                vocab_size=get("vocab_size"),
                max_position_embeddings=_max_positions(get),
                tie_word_embeddings=get("tie_word_embeddings", True) is not False,
                qkv_bias=bias,
                o_bias=bias,
                mlp_bias=bias,
                word_embed_proj_dim=get("word_embed_proj_dim"),
            )
        attention_bias = bool(get("attention_bias", False))
        moe = arch in MOE_ARCHITECTURES
        glm = arch == "Glm4MoeForCausalLM"
        window = get("sliding_window")
        if get("use_sliding_window", True) is False:
            window = None
        window = window if isinstance(window, int) and window > 0 else None
        num_layers = get("num_hidden_layers")
        return cls(
            architecture=arch,
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or _div(hidden, heads),
            intermediate_size=get("intermediate_size"),
            vocab_size=get("vocab_size"),
            max_position_embeddings=_max_positions(get),
            tie_word_embeddings=bool(get("tie_word_embeddings", arch == "Gemma3ForCausalLM")),
            qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or attention_bias,
            o_bias=attention_bias and not glm,  # GLM-4.5's o_proj has no bias
            mlp_bias=bool(get("mlp_bias", False)),
            num_experts=(_first(get, "num_local_experts", "num_experts", "n_routed_experts") or 0)
            if moe
            else 0,
            num_experts_per_tok=(get("num_experts_per_tok") or 0) if moe else 0,
            moe_intermediate_size=(get("moe_intermediate_size") or 0) if moe else 0,
            shared_expert_intermediate_size=_shared_expert_size(get, arch),
            decoder_sparse_step=(get("decoder_sparse_step") or 1) if moe else 1,
            mlp_only_layers=tuple(get("mlp_only_layers") or ()) if moe else (),
            qk_norm=arch in QK_NORM_ARCHITECTURES or (glm and bool(get("use_qk_norm", False))),
            sliding_window=window,
            layer_types=_layer_types(get, arch, num_layers, window),
            attention_sinks=arch == "GptOssForCausalLM",
            moe_bias=arch == "GptOssForCausalLM",
            first_k_dense_replace=(get("first_k_dense_replace") or 0) if glm else 0,
            expert_score_bias=glm,
            shared_expert_gate=not glm,
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: tuple[str, ...] | None = None
    ) -> ModelShape:
        """From a GGUF file's key-value metadata (values as the reader decodes them; an array may
        be given by its length). `tensor_names` decides tie_word_embeddings: tied when the file
        stores no separate `output.weight`."""
        gguf_arch = str(metadata.get("general.architecture", ""))
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise ConfigError(
                f"GGUF architecture {gguf_arch!r} is not supported",
                f"llmctl reads GGUF files of {', '.join(sorted(GGUF_ARCHITECTURES))}",
            )
        if gguf_arch == "deepseek2":
            # llama.cpp: no gating function recorded means softmax (V2 and V2.5 files)
            values = mla_gguf_values(metadata, tensor_names)
            v3 = values["expert_score_bias"]  # sigmoid gating with e_score_correction_bias
            arch = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
            return cls(architecture=arch, **values)
        values: dict[str, Any] = {}
        for key, name in GGUF_KEYS.items():
            value = metadata.get(f"{gguf_arch}.{key}")
            if value is not None:
                values[name] = int(value)
        if not values.get("sliding_window"):
            values.pop("sliding_window", None)  # Phi-4's 0: no window
        if "vocab_size" not in values and GGUF_TOKENS in metadata:
            tokens = metadata[GGUF_TOKENS]
            values["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
        heads = values.get("num_attention_heads")
        hidden = values.get("hidden_size")
        values.setdefault("num_kv_heads", heads)
        if "head_dim" not in values:
            values["head_dim"] = _div(hidden, heads)
        if gguf_arch == "gpt2":
            values.setdefault("intermediate_size", 4 * hidden if hidden else None)
        values.setdefault("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS)
        values.setdefault("num_experts", 0)
        tied = tensor_names is not None and "output.weight" not in tensor_names
        arch = GGUF_ARCHITECTURES[gguf_arch]
        if arch == "LlamaForCausalLM" and values["num_experts"]:
            arch = "MixtralForCausalLM"  # llama.cpp writes Mixtral as llama with experts
        bias = arch == "GPT2LMHeadModel"
        return cls(
            architecture=arch,
            tie_word_embeddings=tied or bias,
            qkv_bias=bias or arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
            o_bias=bias,
            mlp_bias=bias,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            layer_types=_gguf_layer_types(gguf_arch, values),
            **values,
        )

    def hf_config_values(self) -> dict[str, Any]:
        """This shape in a Hugging Face config's keys (the GGUF converter writes these)."""
        if self.is_mla:
            return mla_hf_config_values(self)
        if self.family == "gpt2":
            return {
                "n_layer": self.num_layers,
                "n_embd": self.hidden_size,
                "n_head": self.num_attention_heads,
                "n_inner": self.intermediate_size,
                "n_positions": self.max_position_embeddings,
                "vocab_size": self.vocab_size,
                "tie_word_embeddings": self.tie_word_embeddings,
            }
        return {
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
        }

    # -- partitions ----------------------------------------------------------------------------

    def tensor_parallel_heads(self, tp: int) -> list[HeadShard]:
        """The attention heads of each tensor-parallel rank (as QKVParallelLinear splits them)."""
        return head_shards(self.num_attention_heads, self.num_kv_heads, tp)

    def head_shard(self, tp_rank: int, tp: int) -> HeadShard:
        return self.tensor_parallel_heads(tp)[tp_rank]

    def intermediate_shard(self, tp_rank: int, tp: int) -> int:
        return column_shards(self.intermediate_size, tp, "MLP features")[tp_rank]

    def vocab_shard(self, tp_rank: int, tp: int) -> int:
        return column_shards(self.vocab_size, tp, "vocabulary entries")[tp_rank]

    def check_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> None:
        """ConfigError naming the valid sizes when the layers cannot split this model tp ways
        (with `expert_parallel`, whole experts over the tp ranks)."""
        head_shards(self.num_attention_heads, self.num_kv_heads, tp)
        column_shards(self.intermediate_size, tp, "MLP features")
        column_shards(self.vocab_size, tp, "vocabulary entries")
        if self.num_experts and expert_parallel:
            self.expert_shards(tp)
        elif self.num_experts:
            column_shards(self.expert_intermediate_size, tp, "expert MLP features")
        if self.shared_expert_intermediate_size:
            column_shards(self.shared_expert_intermediate_size, tp, "shared expert features")

    def moe_params(self, tp_rank: int = 0, tp: int = 1, expert_parallel: bool = False) -> int:
        """A MoE layer's MLP on `tp_rank`: its experts (a slice of each, or whole experts with
        `expert_parallel`), the router (and DeepSeek's float32 routing bias, counted as one
        parameter per expert), and the shared expert (Qwen2-MoE's with its gate)."""
        h = self.hidden_size
        if expert_parallel:
            experts = self.expert_shards(tp)[tp_rank]
            inter = self.expert_intermediate_size
        else:
            experts = self.num_experts
            inter = column_shards(self.expert_intermediate_size, tp, "expert MLP features")[tp_rank]
        params = experts * 3 * h * inter + self.num_experts * h  # experts + router
        params += self.num_experts if self.expert_score_bias else 0
        if self.moe_bias:  # gpt-oss: each expert's gate, up and down biases; the router's
            params += experts * (2 * inter + h) + self.num_experts
        if self.shared_expert_intermediate_size:
            shared = column_shards(self.shared_expert_intermediate_size, tp, "shared features")
            params += 3 * h * shared[tp_rank]
            params += h if self.shared_expert_gate else 0
        return params

    # -- parameters per rank -------------------------------------------------------------------

    def layer_params(
        self,
        tp_rank: int = 0,
        tp: int = 1,
        expert_parallel: bool = False,
        layer: int | None = None,
    ) -> int:
        """Parameters of decoder layer `layer` on `tp_rank` of `tp` ranks (its MLP dense or a
        mixture as `is_moe_layer` says; `layer` None: a MoE model's layer counted as MoE)."""
        h, d = self.hidden_size, self.head_dim
        shard = self.head_shard(tp_rank, tp)
        inter = self.intermediate_shard(tp_rank, tp)
        q, kv = shard.num_q_heads * d, shard.num_kv_heads * d
        if self.family in ("llama", "gemma3"):
            if self.is_mla:
                attn = mla_attention_params(self, shard.num_q_heads)
            else:
                attn = h * (q + 2 * kv) + q * h
                attn += (q + 2 * kv) if self.qkv_bias else 0
                attn += h if self.o_bias else 0
                attn += 2 * d if self.qk_norm else 0
                attn += shard.num_q_heads if self.attention_sinks else 0
            mlp = 3 * h * inter + (2 * inter + h if self.mlp_bias else 0)
            moe = self.num_experts > 0 if layer is None else self.is_moe_layer(layer)
            if moe:
                mlp = self.moe_params(tp_rank, tp, expert_parallel)
            # two RMSNorms; Gemma 3 adds one after attention and one after the MLP
            return attn + mlp + (4 if self.family == "gemma3" else 2) * h
        # GPT-2 and OPT: q, k, v and the output projection with biases, a two-matrix MLP with
        # biases, two LayerNorms (weight and bias).
        attn = h * 3 * q + 3 * q + q * h + h
        mlp = h * inter + inter + inter * h + h
        return attn + mlp + 4 * h

    def embedding_params(self, tp_rank: int = 0, tp: int = 1) -> int:
        """The first stage's embeddings (token, positions, OPT's project_in)."""
        width = self.embedding_width
        params = self.vocab_shard(tp_rank, tp) * width
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
        width = self.embedding_width
        norm = self.hidden_size if self.family in ("llama", "gemma3") else 2 * self.hidden_size
        if self.family == "opt" and width != self.hidden_size:
            norm = width * self.hidden_size  # project_out (opt-350m drops the final norm)
        lm_head = self.vocab_shard(tp_rank, tp) * width
        if self.tie_word_embeddings and with_embedding:
            lm_head = 0
        return norm + lm_head

    def rank_params(
        self,
        layers: int,
        tp_rank: int,
        tp: int,
        *,
        is_first: bool,
        is_last: bool,
        start: int = 0,
        expert_parallel: bool = False,
    ) -> int:
        """Parameters one rank holds: its stage's layers [start, start + layers), plus the
        embedding on the first stage and the final norm and LM head on the last."""
        params = sum(
            self.layer_params(tp_rank, tp, expert_parallel, layer)
            for layer in range(start, start + layers)
        )
        if is_first:
            params += self.embedding_params(tp_rank, tp)
        if is_last:
            params += self.head_params(tp_rank, tp, with_embedding=is_first)
        return params

    def total_params(self) -> int:
        return self.rank_params(self.num_layers, 0, 1, is_first=True, is_last=True)

    # -- KV cache ------------------------------------------------------------------------------

    def kv_bytes_per_token(self, layers: int, tp_rank: int, tp: int, kv_dtype_bytes: int) -> int:
        """K and V of one token across `layers` layers on one tensor-parallel rank. MLA: the
        latent and the rope key (kv_lora_rank + qk_rope_head_dim), whole on every rank."""
        if self.is_mla:
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_dtype_bytes
        shard = self.head_shard(tp_rank, tp)
        return 2 * layers * shard.num_kv_heads * self.head_dim * kv_dtype_bytes

    def kv_cache_bytes_per_block(
        self, layers: int, tp_rank: int, tp: int, kv_dtype_bytes: int, block_size: int
    ) -> int:
        """One KV cache block on one rank: as ModelRunner.kv_cache_bytes_per_block measures it
        from the attention layers it built."""
        return block_size * self.kv_bytes_per_token(layers, tp_rank, tp, kv_dtype_bytes)


def _shared_expert_size(get, arch: str) -> int:
    """Features of the shared expert(s): Qwen2-MoE's one, GLM-4.5's n_shared_experts of
    moe_intermediate_size each (one MLP, as transformers builds it)."""
    if arch == "Qwen2MoeForCausalLM":
        return get("shared_expert_intermediate_size") or 0
    if arch == "Glm4MoeForCausalLM":
        return (get("moe_intermediate_size") or 0) * (get("n_shared_experts") or 0)
    return 0


def _getter(cfg: Any):
    if isinstance(cfg, Mapping):
        return lambda name, default=None: cfg.get(name, default)
    return lambda name, default=None: getattr(cfg, name, default)


def _architecture(get) -> str:
    archs = get("architectures") or []
    if archs:
        return archs[0]
    model_type = get("model_type") or ""
    if model_type in ARCHITECTURE_BY_MODEL_TYPE:
        return ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise ConfigError(
        f"the model's config names no architectures (model_type {model_type!r})",
        'add "architectures": ["LlamaForCausalLM"] (or the right class) to config.json',
    )


def _layer_types(get, arch: str, num_layers: Any, window: int | None) -> tuple[str, ...]:
    """Each layer's attention type as transformers 5 derives it: config.layer_types when given,
    else Qwen's sliding layers from max_window_layers on, Gemma 3's sliding_window_pattern
    (every 6th layer global), gpt-oss's alternation; () when every layer is alike."""
    if window is None or not isinstance(num_layers, int) or num_layers < 1:
        return ()
    given = get("layer_types")
    if given:
        return tuple(given)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and get("max_window_layers") is not None:
        first = get("max_window_layers")
        return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))
    if arch == "Gemma3ForCausalLM":
        period = _first(get, "sliding_window_pattern", "_sliding_window_pattern") or 6
        return _every_nth_global(period, num_layers)
    if arch == "GptOssForCausalLM":
        return _every_nth_global(2, num_layers)
    return ()


def _every_nth_global(period: int, num_layers: int) -> tuple[str, ...]:
    """Sliding layers with every `period`-th one global (layers period - 1, 2 * period - 1...)."""
    return tuple(
        FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )


def _gguf_layer_types(gguf_arch: str, values: dict) -> tuple[str, ...]:
    """llama.cpp's fixed pattern for a Gemma 3 GGUF, which stores no per-layer list: every 6th
    layer global."""
    num_layers = values.get("num_layers")
    if gguf_arch != "gemma3" or not values.get("sliding_window") or not num_layers:
        return ()
    return _every_nth_global(6, num_layers)


def _first(get, *names):
    for name in names:
        value = get(name)
        if value is not None:
            return value
    return None


def _div(hidden: Any, heads: Any) -> Any:
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None  # __post_init__ names the missing value


def _max_positions(get) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_MAX_POSITION_EMBEDDINGS
