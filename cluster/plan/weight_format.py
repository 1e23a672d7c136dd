"""WeightFormat: how a weight tensor is stored (a float dtype, a GGUF block type, int8/int4 groups),
and the bytes each rank's shards of a model take in it. Pure: no torch, no gguf, no numpy, so
`llmctl plan` stays instant.

A format stores `block_size` weights of a row in `block_bytes` bytes: a float dtype is a block of
one; GGML's Q4_1 packs 32 weights in 20 bytes (16 bytes of nibbles, a float16 scale and minimum);
`--quantization int4` stores each group of 32 as nibbles plus a scale and a zero
(`quantization_format`). A row of K weights takes ceil(K / block_size) blocks; a row-parallel
split of K that cuts a group is refused (`cut_groups`), as the engine refuses it.

The tensors of one rank (`layer_tensors`, `embedding_tensors`, `head_tensors`) are ModelShape's
parameter count broken down by role, split as the engine's layers split them: their sum is
`ModelShape.rank_params` exactly (tests/unit/test_weight_format.py holds them equal).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.distributed.partition import column_shards
from llmctl.engine.errors import ConfigError
from llmctl.engine.layers.quantization.quant_config import (
    FP8_METHOD,
    QUANTIZATION_METHODS,
    RTN_GROUP_SIZE,
)

# The roles of the matrices `--quantization` quantizes (weight-only: the decoder layers' linears;
# the embedding, the LM head, norms and biases stay in the model's dtype, as in vLLM; so do a
# mixture of experts' routers, "router" and "shared_expert_gate").
LINEAR_ROLES = ("q", "k", "v", "qkv", "o", "gate", "up", "down", "q_a", "q_b", "kv_a")
SHARED_EXPERT_ROLES = ("shared_gate", "shared_up", "shared_down")  # Qwen2-MoE's shared expert
# Held in float32 whatever the model's dtype: DeepSeek-V3's and GLM-4.5's routing bias.
FLOAT32_ROLES = ("expert_bias",)
# Scales and zeros of `--quantization`'s groups are float32 (engine/kernels/cpu/quantized_matmul.py:
# the packed-weight contract); a kernel storing them in bfloat16 changes this one number.
QUANTIZATION_SCALE_BYTES = 4


@dataclass(frozen=True)
class WeightFormat:
    name: str  # "bfloat16", "Q4_1", "int4", "fp8"
    block_size: int  # weights per block (along a row: the matmul's input features)
    block_bytes: int  # bytes per block
    quantized: bool = False
    # Of block_bytes, the block's scale: a partial block at a row's end holds its own weights
    # and one scale (FP8); 0: every block is whole (GGUF, int8/int4)
    scale_bytes: int = 0

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block_size

    def nbytes(self, rows: int, cols: int = 1) -> int:
        """A [rows, cols] tensor: rows of ceil(cols / block_size) blocks."""
        blocks = math.ceil(cols / self.block_size)
        if self.scale_bytes:
            weight_bytes = (self.block_bytes - self.scale_bytes) // self.block_size
            return rows * (cols * weight_bytes + blocks * self.scale_bytes)
        return rows * blocks * self.block_bytes


# Block FP8 as the engine holds it (kernels/cpu/fp8_matmul.py): a byte a weight, each row a
# float32 scale per block of 128 inputs (its block's weight_scale_inv).
FP8_FORMAT = WeightFormat("fp8", 128, 128 + 4, quantized=True, scale_bytes=4)


@dataclass(frozen=True)
class QuantizationScheme:
    """`--quantization`: weight-only, round-to-nearest, per group of `group_size` input features,
    each group with a float scale and (asymmetric schemes) a float zero."""

    name: str
    bits: int
    group_size: int
    zero_point: bool

    @property
    def group_bytes(self) -> int:
        scales = QUANTIZATION_SCALE_BYTES * (2 if self.zero_point else 1)
        return self.group_size * self.bits // 8 + scales

    @property
    def format(self) -> WeightFormat:
        return WeightFormat(self.name, self.group_size, self.group_bytes, quantized=True)


# --quantization's schemes, the largest first, as the engine quantizes them (quantize_rtn in
# engine/layers/quantization/linear_method.py): int8 symmetric, int4 with a zero per group.
QUANTIZATION_SCHEMES = {
    name: QuantizationScheme(
        name,
        bits=int(name.removeprefix("int")),
        group_size=RTN_GROUP_SIZE,
        zero_point=name == "int4",
    )
    for name in QUANTIZATION_METHODS
}


def quantization_format(name: str) -> WeightFormat:
    """The storage of `--quantization NAME`; ConfigError naming the schemes for another name."""
    if name == FP8_METHOD:
        return FP8_FORMAT
    if name not in QUANTIZATION_SCHEMES:
        raise ConfigError(
            f"unknown quantization {name!r}",
            f"use --quantization {' or '.join([*QUANTIZATION_SCHEMES, FP8_METHOD])}",
        )
    return QUANTIZATION_SCHEMES[name].format


def dense_format(dtype: str, dtype_bytes: int) -> WeightFormat:
    return WeightFormat(dtype, 1, dtype_bytes)


@dataclass(frozen=True)
class Tensor:
    """One weight of one rank: `rows` x `cols` as this rank holds it (a vector has cols=1)."""

    role: str  # "q", "down", "embedding", "lm_head", "attn_norm", "q_bias", ...
    rows: int
    cols: int = 1  # 1: a vector (norms, biases)
    full_cols: int | None = None  # the inputs before a row-parallel split (None: unsplit)

    @property
    def is_vector(self) -> bool:
        return self.cols == 1 and self.full_cols is None

    @property
    def is_split(self) -> bool:
        return self.full_cols is not None and self.full_cols != self.cols


@dataclass(frozen=True)
class WeightFormats:
    """The format of each weight of a model: `by_role` maps (layer index or None for every
    layer, role) to a format; a weight not listed, and every vector (norms, biases), is held in
    `dense` (the model's dtype).

    `source` names where the quantized formats came from: "GGUF" (the file's tensor types) or
    the `--quantization` scheme."""

    dense: WeightFormat
    by_role: tuple[tuple[tuple[int | None, str], WeightFormat], ...] = ()
    source: str | None = None

    @classmethod
    def for_quantization(cls, dense: WeightFormat, quantization: str | None) -> WeightFormats:
        if quantization is None:
            return cls(dense)
        fmt = quantization_format(quantization)
        roles = LINEAR_ROLES + SHARED_EXPERT_ROLES
        return cls(dense, tuple(((None, role), fmt) for role in roles), quantization)

    @classmethod
    def for_fp8_checkpoint(cls, dense: WeightFormat) -> WeightFormats:
        """A block-FP8 checkpoint: every linear layer in FP8 as the engine holds it (MLA's
        kv_b_proj, dequantized at load, and the routers in the model's dtype)."""
        roles = LINEAR_ROLES + SHARED_EXPERT_ROLES
        return cls(dense, tuple(((None, role), FP8_FORMAT) for role in roles), "FP8 checkpoint")

    @property
    def quantized(self) -> bool:
        return any(fmt.quantized for _, fmt in self.by_role)

    def with_dense(self, dense: WeightFormat) -> WeightFormats:
        return WeightFormats(dense, self.by_role, self.source)

    def format_of(self, layer: int | None, tensor: Tensor) -> WeightFormat:
        if tensor.role in FLOAT32_ROLES:
            return dense_format("float32", 4)
        if tensor.is_vector:
            return self.dense  # a vector: norms and biases are held in the model's dtype
        table = self._table()
        return table.get((layer, tensor.role)) or table.get((None, tensor.role)) or self.dense

    def _layer_types(self) -> bool:
        """Whether formats are given layer by layer (a GGUF file), not for every layer alike."""
        return any(layer is not None for (layer, _), _ in self.by_role)

    def _table(self) -> dict:
        table = self.__dict__.get("_cached")
        if table is None:
            table = dict(self.by_role)
            object.__setattr__(self, "_cached", table)
        return table

    def label(self) -> str:
        """What the weights are held in, as a plan prints it: "Q4_1 GGUF", "int4", "bfloat16":
        the format of the most decoder-layer weights (a GGUF mixes types)."""
        if not self.quantized:
            return self.dense.name
        counts: dict[str, int] = {}
        for (_, role), fmt in self.by_role:
            if role in LINEAR_ROLES and fmt.quantized:
                counts[fmt.name] = counts.get(fmt.name, 0) + 1
        name = max(counts, key=counts.get) if counts else self.by_role[0][1].name
        return f"{name} GGUF" if self.source == "GGUF" else name

    def detail(self, shape: ModelShape) -> str:
        """Every format by the roles it holds in this shape: "Q4_1 (q, k, v, o, gate, up, down),
        Q8_0 (embedding), float32 (the rest)"."""
        order = [t.role for t in layer_tensors(shape, 0, 1) + embedding_tensors(shape, 0, 1)]
        order += ["lm_head"]
        roles: dict[str, set[str]] = {}
        for (_, role), fmt in self.by_role:
            roles.setdefault(fmt.name, set()).add(role)
        parts = [
            f"{name} ({', '.join(r for r in order if r in held)})"
            for name, held in roles.items()
            if any(r in held for r in order)
        ]
        return ", ".join([*parts, f"{self.dense.name} (the rest)"])

    # -- bytes per rank ------------------------------------------------------------------------

    def tensors_bytes(self, layer: int | None, tensors: Iterable[Tensor]) -> int:
        return sum(self.format_of(layer, t).nbytes(t.rows, t.cols) for t in tensors)

    def rank_bytes(
        self,
        shape: ModelShape,
        layers: tuple[int, int],
        tp_rank: int,
        tp: int,
        *,
        is_first: bool,
        is_last: bool,
        expert_parallel: bool = False,
    ) -> int:
        """Bytes one rank holds: its stage's layers [start, end), plus the embedding on the first
        stage and the final norm and LM head on the last (ModelShape.rank_params, in bytes).
        `expert_parallel`: a MoE model's experts are held whole, dealt out over the tp ranks."""
        total = sum(
            self.layer_bytes(shape, i, tp_rank, tp, expert_parallel) for i in range(*layers)
        )
        if is_first:
            total += self.tensors_bytes(None, embedding_tensors(shape, tp_rank, tp))
        if is_last:
            head = head_tensors(shape, tp_rank, tp, with_embedding=is_first)
            # A tied LM head on a stage without the embedding holds a copy of the embedding.
            total += sum(self._head_format(shape, t).nbytes(t.rows, t.cols) for t in head)
        return total

    def max_layer_bytes(
        self, shape: ModelShape, tp_rank: int, tp: int, expert_parallel: bool = False
    ) -> int:
        """The largest decoder layer on `tp_rank` (GGUF files may mix types layer by layer;
        DeepSeek's first layers are dense)."""
        return max(
            self.layer_bytes(shape, i, tp_rank, tp, expert_parallel)
            for i in range(shape.num_layers)
        )

    def layer_bytes(
        self, shape: ModelShape, layer: int, tp_rank: int, tp: int, expert_parallel: bool = False
    ) -> int:
        """Decoder layer `layer` on `tp_rank` (memoized per kind of layer: dense or MoE, and per
        layer where a GGUF file gives formats layer by layer)."""
        moe = shape.is_moe_layer(layer) if shape.num_experts else None
        which = layer if self._layer_types() else None
        key = (id(shape), which, moe, tp_rank, tp, expert_parallel)
        cache = self.__dict__.setdefault("_layer_bytes", {})
        if key not in cache:
            per_layer = layer_tensors(shape, tp_rank, tp, expert_parallel, layer)
            cache[key] = self.tensors_bytes(which, per_layer)
        return cache[key]

    def _head_format(self, shape: ModelShape, tensor: Tensor) -> WeightFormat:
        if tensor.role == "lm_head" and shape.tie_word_embeddings and self.source == "GGUF":
            # The engine's copy of the tied GGUF embedding, in the file's type.
            return self.format_of(None, Tensor("embedding", tensor.rows, tensor.cols))
        return self.format_of(None, tensor)

    def cut_groups(self, shape: ModelShape, tp: int, expert_parallel: bool = False) -> list[str]:
        """The row-parallel weights (o, down) whose input split on some rank of `tp` cuts a
        quantization group: "down (384 of 1536 inputs; groups of 256)". The engine's rule
        (quant_config.check_group_split): every row-parallel split falls on whole groups of the
        largest block among the quantized formats (`expert_parallel`: a MoE model's experts are
        whole on each rank, their down matrices unsplit)."""
        blocks = [fmt.block_size for _, fmt in self.by_role if fmt.quantized]
        if not blocks:
            return []
        if any(fmt.scale_bytes for _, fmt in self.by_role):  # FP8: rows and inputs alike
            from llmctl.engine.layers.quantization.fp8 import block_cuts

            return block_cuts(shape, tp, (max(blocks), max(blocks)), expert_parallel)
        group = max(blocks)
        cuts: list[str] = []
        for tp_rank in range(tp):
            for layer in _one_layer_of_each_kind(shape):
                for t in layer_tensors(shape, tp_rank, tp, expert_parallel, layer):
                    if (
                        t.is_split
                        and t.cols % group
                        and not any(c.startswith(t.role) for c in cuts)
                    ):
                        what = f"{t.cols} of {t.full_cols} inputs; groups of {group}"
                        cuts.append(f"{t.role} ({what})")
        return cuts

    def check_split(
        self, shape: ModelShape, tp: int, valid: Iterable[int], expert_parallel: bool = False
    ) -> None:
        """ConfigError naming the tensor-parallel sizes that split whole blocks, when `tp` cuts
        one."""
        cuts = self.cut_groups(shape, tp, expert_parallel)
        if cuts:
            ok = [str(t) for t in valid if not self.cut_groups(shape, t, expert_parallel)]
            raise ConfigError(
                f"tensor_parallel_size={tp} cuts the quantization groups of {cuts[0]}",
                f"use tensor_parallel_size {', '.join(ok)}, or pipeline parallel",
            )


def _one_layer_of_each_kind(shape: ModelShape) -> list[int]:
    """The first dense and the first MoE layer (those the model has)."""
    first: dict[bool, int] = {}
    for layer in range(shape.num_layers):
        first.setdefault(shape.is_moe_layer(layer), layer)
    return sorted(first.values())


def gguf_weight_formats(
    dense: WeightFormat, tensor_types: Iterable[tuple[str, str]], arch: str = ""
) -> WeightFormats:
    """The formats of a GGUF file's quantized tensors as the engine holds them: `tensor_types`
    gives (tensor name, GGML type name); each quantized type is repacked at load into groups of
    `bits`-bit values with scales (and zeros for 4 bits), PACKED_FORMATS in
    engine/layers/quantization/gguf_quants.py. Float tensors (F32, F16, BF16) are left to
    `dense`: the engine holds them in the model's dtype. `arch`: the file's
    general.architecture (Phi-3's fused tensors give their parts' formats). A format's block
    is the file's (a
    tensor-parallel split must fall on whole blocks: the engine narrows the raw blocks before
    decoding them), its bytes what the engine holds for one block."""
    from llmctl.engine.layers.quantization.gguf_quants import (
        BLOCK_ELEMENTS,
        PACKED_FORMATS,
        scale_bytes,
    )

    by_role = []
    for name, type_name in tensor_types:
        key = gguf_tensor_role(name)
        if key is None or type_name in _GGUF_FLOAT_TYPES:
            continue
        bits, group = PACKED_FORMATS[type_name]
        block = BLOCK_ELEMENTS[type_name]
        scales = scale_bytes(type_name) * (2 if bits == 4 else 1)
        held = block * bits // 8 + block // group * scales
        by_role.append((key, WeightFormat(type_name, block, held, quantized=True)))
    fused = _fused_parts(by_role) if arch == "phi3" else []
    return WeightFormats(dense, tuple(by_role + fused), "GGUF")


def _fused_parts(by_role: list) -> list:
    """Phi-3's fused tensors give their parts' formats: attn_qkv q, k and v; ffn_up (its
    [gate | up] rows) the gate."""
    roles = {key: fmt for key, fmt in by_role}
    out = []
    for (layer, role), fmt in roles.items():
        parts = {"qkv": ("q", "k", "v"), "up": ("gate",)}.get(role, ())
        out += [((layer, part), fmt) for part in parts if (layer, part) not in roles]
    return out


_GGUF_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# GGUF tensor name (blk.N.<name>.weight) -> role.
_GGUF_LAYER_ROLES = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_qkv": "qkv",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "ffn_gate_exps": "gate",
    "ffn_up_exps": "up",
    "ffn_down_exps": "down",
    "attn_q_a": "q_a",  # deepseek2's MLA (attn_k_b / attn_v_b: kv_b_proj, held in float)
    "attn_q_b": "q_b",
    "attn_kv_a_mqa": "kv_a",
    "ffn_gate_shexp": "shared_gate",
    "ffn_up_shexp": "shared_up",
    "ffn_down_shexp": "shared_down",
}
_GGUF_MODEL_ROLES = {
    "token_embd": "embedding",
    "output": "lm_head",
    "position_embd": "position_embedding",
}


def gguf_tensor_role(name: str) -> tuple[int | None, str] | None:
    """ "blk.3.attn_q.weight" -> (3, "q"); "token_embd.weight" -> (None, "embedding"); None for a
    vector (norms, biases) or a tensor the shape does not count."""
    parts = name.split(".")
    if parts[-1] != "weight":
        return None
    if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit():
        role = _GGUF_LAYER_ROLES.get(parts[2])
        return (int(parts[1]), role) if role else None
    role = _GGUF_MODEL_ROLES.get(".".join(parts[:-1]))
    return (None, role) if role else None


# -- the tensors of one rank -------------------------------------------------------------------


def layer_tensors(
    shape: ModelShape,
    tp_rank: int,
    tp: int,
    expert_parallel: bool = False,
    layer: int | None = None,
) -> list[Tensor]:
    """Decoder layer `layer`'s weights on `tp_rank`: column-parallel matrices by their output
    rows, row-parallel ones (o, down) by their inputs, their bias whole; norms replicated. Its
    MLP dense or MoE as ModelShape.is_moe_layer says (`layer` None: a MoE model's layer counted
    as MoE)."""
    h, d = shape.hidden_size, shape.head_dim
    shard = shape.head_shard(tp_rank, tp)
    inter = shape.intermediate_shard(tp_rank, tp)
    q, kv = shard.num_q_heads * d, shard.num_kv_heads * d
    full_q, full_inter = shape.num_attention_heads * d, shape.intermediate_size
    moe = shape.num_experts > 0 and (layer is None or shape.is_moe_layer(layer))
    if shape.family in ("llama", "gemma3"):
        if shape.is_mla:
            out = _mla_tensors(shape, shard.num_q_heads)
        else:
            out = [Tensor("q", q, h), Tensor("k", kv, h), Tensor("v", kv, h)]
            if shape.qkv_bias:
                out += [Tensor("q_bias", q), Tensor("k_bias", kv), Tensor("v_bias", kv)]
            out.append(Tensor("o", h, q, full_q))
            if shape.o_bias:
                out.append(Tensor("o_bias", h))
            if shape.qk_norm:
                out += [Tensor("q_norm", d), Tensor("k_norm", d)]
            if shape.attention_sinks:
                out.append(Tensor("sinks", shard.num_q_heads))
        if moe:
            out += _moe_tensors(shape, tp_rank, tp, expert_parallel)
        else:
            out += [
                Tensor("gate", inter, h),
                Tensor("up", inter, h),
                Tensor("down", h, inter, full_inter),
            ]
        if not moe and shape.mlp_bias:
            out += [Tensor("gate_bias", inter), Tensor("up_bias", inter), Tensor("down_bias", h)]
        out += [Tensor("attn_norm", h), Tensor("ffn_norm", h)]
        if shape.family == "gemma3":
            out += [Tensor("post_attention_norm", h), Tensor("post_ffw_norm", h)]
        return out
    # GPT-2 and OPT: fused q, k, v and the output projection with biases, a two-matrix MLP with
    # biases, two LayerNorms (weight and bias).
    return [
        Tensor("qkv", 3 * q, h),
        Tensor("qkv_bias", 3 * q),
        Tensor("o", h, q, full_q),
        Tensor("o_bias", h),
        Tensor("up", inter, h),
        Tensor("up_bias", inter),
        Tensor("down", h, inter, full_inter),
        Tensor("down_bias", h),
        Tensor("attn_norm", 2 * h),
        Tensor("ffn_norm", 2 * h),
    ]


def _mla_tensors(shape: ModelShape, num_q_heads: int) -> list[Tensor]:
    """Multi-head latent attention on a rank of `num_q_heads` heads (engine/config/mla_shape.py;
    kv_b_proj is held in the model's dtype even when the rest is quantized: its rows are the
    absorbed decode's weights)."""
    h, heads, v = shape.hidden_size, shape.num_attention_heads, shape.v_head_dim
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    latent, lora = shape.kv_lora_rank + shape.qk_rope_head_dim, shape.q_lora_rank
    if lora:
        out = [
            Tensor("q_a", lora, h),
            Tensor("q_a_norm", lora),
            Tensor("q_b", num_q_heads * qk, lora),
        ]
        out += [Tensor("q_a_bias", lora)] if shape.qkv_bias else []
    else:
        out = [Tensor("q", num_q_heads * qk, h)]
    out += [Tensor("kv_a", latent, h), Tensor("kv_a_norm", shape.kv_lora_rank)]
    out += [Tensor("kv_a_bias", latent)] if shape.qkv_bias else []
    out.append(Tensor("kv_b", num_q_heads * (shape.qk_nope_head_dim + v), shape.kv_lora_rank))
    out.append(Tensor("o", h, num_q_heads * v, heads * v))
    return out + ([Tensor("o_bias", h)] if shape.o_bias else [])


def _moe_tensors(shape: ModelShape, tp_rank: int, tp: int, expert_parallel: bool) -> list[Tensor]:
    """A MoE layer's MLP on `tp_rank`, as FusedMoE holds it: every expert's slice of the
    features (tensor parallel) or this rank's whole experts (expert parallel); the router
    replicated; Qwen2-MoE's shared expert split like a dense MLP, its gate replicated."""
    h, full = shape.hidden_size, shape.expert_intermediate_size
    if expert_parallel:
        experts, inter = shape.expert_shards(tp)[tp_rank], full
    else:
        experts = shape.num_experts
        inter = column_shards(full, tp, "expert MLP features")[tp_rank]
    out = [
        Tensor("gate", experts * inter, h),
        Tensor("up", experts * inter, h),
        Tensor("down", experts * h, inter, full),
        Tensor("router", shape.num_experts * h),
    ]
    if shape.expert_score_bias:
        out.append(Tensor("expert_bias", shape.num_experts))
    if shape.moe_bias:  # gpt-oss
        out += [
            Tensor("gate_up_bias", experts * 2 * inter),
            Tensor("down_bias", experts * h),
            Tensor("router_bias", shape.num_experts),
        ]
    if shape.shared_expert_intermediate_size:
        full_shared = shape.shared_expert_intermediate_size
        shared = column_shards(full_shared, tp, "shared expert features")[tp_rank]
        out += [
            Tensor("shared_gate", shared, h),
            Tensor("shared_up", shared, h),
            Tensor("shared_down", h, shared, full_shared),
        ]
        if shape.shared_expert_gate:
            out.append(Tensor("shared_expert_gate", h))
    return out


def embedding_tensors(shape: ModelShape, tp_rank: int, tp: int) -> list[Tensor]:
    """The first stage's embeddings (token, positions, OPT's project_in)."""
    width = shape.embedding_width
    out = [Tensor("embedding", shape.vocab_shard(tp_rank, tp), width)]
    if shape.family == "gpt2":
        out.append(Tensor("position_embedding", shape.max_position_embeddings, shape.hidden_size))
    if shape.family == "opt":
        positions = shape.max_position_embeddings + 2
        out.append(Tensor("position_embedding", positions, shape.hidden_size))
        if width != shape.hidden_size:
            out.append(Tensor("project_in", shape.hidden_size, width))
    return out


def head_tensors(
    shape: ModelShape, tp_rank: int, tp: int, with_embedding: bool = True
) -> list[Tensor]:
    """The last stage's final norm and LM head (none when tied to an embedding on the same
    stage)."""
    width, h = shape.embedding_width, shape.hidden_size
    if shape.family == "opt" and width != h:
        out = [Tensor("project_out", width, h)]  # opt-350m drops the final norm
    else:
        out = [Tensor("output_norm", h if shape.family in ("llama", "gemma3") else 2 * h)]
    if not (shape.tie_word_embeddings and with_embedding):
        out.append(Tensor("lm_head", shape.vocab_shard(tp_rank, tp), width))
    return out
