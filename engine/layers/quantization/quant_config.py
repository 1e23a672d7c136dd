"""QuantizationConfig: how a model's linear weights are stored (torch-free: the planner reads it).

"gguf": the GGUF file's own block formats, read natively (chosen automatically for a quantized
GGUF). "int8" / "int4": weight-only, per-group round-to-nearest quantization of a float checkpoint
(`--quantization`). Embeddings of RTN models, norms and activations stay float.
"fp8": block FP8 (quantization/fp8.py): a checkpoint that ships it (quantization_config with
quant_method "fp8" and weight_block_size, as DeepSeek-V3, Kimi-K2, Qwen3-235B-A22B-FP8), or
`--quantization fp8` on a float checkpoint (per-block round-to-nearest as the layers read it).

A row-parallel layer splits its input features (K) across tensor-parallel ranks; a split must fall
on whole quantization groups (GGUF blocks), so `check_group_split` refuses a tp size that cuts one
and names the sizes that do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import ConfigError, UnsupportedQuantizationError

QUANTIZATION_METHODS = ("int8", "int4")  # --quantization's round-to-nearest integer schemes
FP8_METHOD = "fp8"  # --quantization fp8, and checkpoints in block FP8
FLAG_METHODS = (*QUANTIZATION_METHODS, FP8_METHOD)  # what --quantization accepts
RTN_GROUP_SIZE = 32  # weights per scale for --quantization int8 / int4

# GGUF tensor types llmctl reads: float ones load as float, quantized ones stay packed.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
GGUF_QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
# Weights per block of each quantized type: the granularity of a split along K.
GGUF_BLOCK_SIZES = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "gguf", "int8" or "int4"
    # int8/int4: weights per scale. gguf: the largest block of the file's quantized types (the
    # granularity a tensor-parallel split along K must respect).
    group_size: int = RTN_GROUP_SIZE
    gguf_types: tuple[str, ...] = ()  # gguf: the quantized tensor types the file holds
    # fp8: (rows, columns) a scale covers, and whether the checkpoint holds FP8 already (else
    # each layer's float rows are quantized as they are read)
    weight_block_size: tuple[int, int] = (128, 128)
    checkpoint_fp8: bool = False

    def __post_init__(self) -> None:
        if self.method not in ("gguf", *FLAG_METHODS):
            raise ConfigError(
                f"unknown quantization {self.method!r}",
                f"use --quantization {' or '.join(FLAG_METHODS)}, or leave it out",
            )
        if self.method == FP8_METHOD:
            block = self.weight_block_size
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ConfigError(f"weight_block_size must be two positive sizes, got {block}")
        elif self.method != "gguf" and self.group_size not in (32, 64, 128):
            raise ConfigError(
                f"quantization group size must be 32, 64 or 128, got {self.group_size}"
            )
        unsupported = sorted(set(self.gguf_types) - set(GGUF_QUANTIZED_TYPES))
        if unsupported:
            raise unsupported_gguf_types(unsupported)

    @property
    def bits(self) -> int | None:
        """int8: 8, int4: 4; gguf: None (per tensor, from its type)."""
        return {"int8": 8, "int4": 4}.get(self.method)

    @classmethod
    def for_gguf(cls, tensor_types: list[str] | tuple[str, ...]) -> QuantizationConfig | None:
        """The config of a GGUF file holding tensors of these types (None: all float)."""
        unsupported = sorted(set(tensor_types) - set(GGUF_QUANTIZED_TYPES + GGUF_FLOAT_TYPES))
        if unsupported:
            raise unsupported_gguf_types(unsupported)
        quantized = tuple(sorted(set(tensor_types) & set(GGUF_QUANTIZED_TYPES)))
        if not quantized:
            return None
        return cls("gguf", max(GGUF_BLOCK_SIZES[t] for t in quantized), quantized)

    @classmethod
    def for_checkpoint(cls, hf_config) -> QuantizationConfig | None:
        """The quantization a Hugging Face checkpoint ships in (its config's
        quantization_config), None for float weights; UnsupportedQuantizationError for a method
        llmctl does not read."""
        qc = getattr(hf_config, "quantization_config", None)
        if qc is None and isinstance(hf_config, dict):
            qc = hf_config.get("quantization_config")
        if qc is None:
            return None
        qc = qc if isinstance(qc, dict) else getattr(qc, "to_dict", lambda: vars(qc))()
        method = str(qc.get("quant_method", "")).lower()
        if method == "mxfp4" and _architecture(hf_config) == "GptOssForCausalLM":
            return None  # its MXFP4 experts are dequantized as they are read (models/gpt_oss.py)
        if method != FP8_METHOD:
            raise UnsupportedQuantizationError(
                f"the checkpoint is quantized with {method or 'an unnamed method'!r}",
                "llmctl reads block-FP8 checkpoints (quant_method fp8, weight_block_size) and "
                "GGUF files; use the model's bfloat16 checkpoint (--quantization int8, int4 or "
                "fp8 quantize it as it loads)",
            )
        block = qc.get("weight_block_size")
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if not block or fmt != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedQuantizationError(
                f"FP8 checkpoint with weight_block_size={block}, fmt={fmt}, "
                f"activation_scheme={qc.get('activation_scheme')}: llmctl reads e4m3 weights "
                "in blocks with dynamic activations (DeepSeek-V3's format), not per-tensor scales",
                "use the model's bfloat16 checkpoint with --quantization fp8",
            )
        return cls(FP8_METHOD, int(block[1]), weight_block_size=tuple(int(b) for b in block),
                   checkpoint_fp8=True)  # fmt: skip


def unsupported_gguf_types(types: list[str]) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"GGUF tensor type {', '.join(types)} is not supported",
        f"llmctl reads {', '.join(GGUF_QUANTIZED_TYPES + GGUF_FLOAT_TYPES)}; re-quantize the "
        "model to one of them (e.g. llama-quantize ... Q4_K_M)",
    )


def resolve_quantization(
    flag: str | None,
    gguf_config: QuantizationConfig | None,
    checkpoint_config: QuantizationConfig | None = None,
) -> QuantizationConfig | None:
    """The model's QuantizationConfig from --quantization and what the checkpoint holds (a GGUF
    file's types, or a Hugging Face checkpoint's quantization_config)."""
    if flag is None:
        return gguf_config or checkpoint_config
    if flag not in FLAG_METHODS:
        raise ConfigError(
            f"unknown quantization {flag!r}",
            f"use --quantization {' or '.join(FLAG_METHODS)}, or leave it out",
        )
    if checkpoint_config is not None:
        if flag == FP8_METHOD:
            return checkpoint_config  # what it ships
        raise ConfigError(
            f"--quantization {flag} was given, but the checkpoint ships in FP8 already",
            "drop --quantization: the checkpoint's own FP8 blocks are used",
        )
    if flag == FP8_METHOD and gguf_config is None:
        return QuantizationConfig(FP8_METHOD, 128)
    if gguf_config is not None:
        raise ConfigError(
            f"--quantization {flag} was given, but the GGUF file is already quantized "
            f"({', '.join(gguf_config.gguf_types)})",
            "drop --quantization: the file's own quantization is used",
        )
    return QuantizationConfig(flag)


def _row_split_sizes(shape: ModelShape, tp: int, expert_parallel: bool = False) -> list[list[int]]:
    """The per-rank input features of the row-parallel layers (o_proj, down_proj) at tp; for a
    mixture of experts, its experts' down matrices (split like down_proj unless expert parallel),
    its shared expert's, and down_proj's where some layers keep a dense MLP (Qwen MoE's
    mlp_only_layers)."""
    from llmctl.engine.distributed.partition import column_shards, head_shards

    heads = head_shards(shape.num_attention_heads, shape.num_kv_heads, tp)
    per_head = shape.v_head_dim if shape.is_mla else shape.head_dim  # o_proj's inputs
    sizes = [[h.num_q_heads * per_head for h in heads]]
    if not all(shape.is_moe_layer(layer) for layer in range(shape.num_layers)):
        sizes.append(column_shards(shape.intermediate_size, tp, "MLP features"))
    elif not expert_parallel:
        sizes.append(column_shards(shape.expert_intermediate_size, tp, "expert MLP features"))
    if shape.shared_expert_intermediate_size:
        sizes.append(
            column_shards(shape.shared_expert_intermediate_size, tp, "shared expert features")
        )
    return sizes


def _splits_on_groups(
    shape: ModelShape, tp: int, group_size: int, expert_parallel: bool = False
) -> bool:
    try:
        sizes = _row_split_sizes(shape, tp, expert_parallel)
    except ConfigError:
        return False
    return all(s % group_size == 0 for split in sizes for s in split)


def valid_group_tp_sizes(
    shape: ModelShape, group_size: int, expert_parallel: bool = False
) -> list[int]:
    return [
        tp
        for tp in range(1, shape.num_attention_heads + 1)
        if _splits_on_groups(shape, tp, group_size, expert_parallel)
    ]


def check_whole_groups(shape: ModelShape, method: str, group_size: int = RTN_GROUP_SIZE) -> None:
    """Refuse --quantization int8/int4 on a model some of whose linear layers do not take whole
    groups of input features (a GGUF file's blocks are whole by construction; FP8's edge blocks
    may be partial)."""
    if method in ("gguf", FP8_METHOD):
        return
    widths = {shape.hidden_size} | {s for split in _row_split_sizes(shape, 1) for s in split}
    widths |= {shape.q_lora_rank} if shape.q_lora_rank else set()  # MLA's q_b_proj
    odd = sorted(w for w in widths if w % group_size)
    if odd:
        raise ConfigError(
            f"--quantization {method} quantizes groups of {group_size} input features, but "
            f"{shape.architecture} has layers of {odd[0]} input features",
            "run this model in float (leave out --quantization)",
        )


def check_group_split(
    shape: ModelShape, tp: int, quant: QuantizationConfig | None, expert_parallel: bool = False
) -> None:
    """Refuse a tensor-parallel size whose row-parallel split cuts a quantization group (and
    --quantization on a model whose layers are not whole groups at all); FP8: a split that cuts
    a block of rows or inputs (quantization/fp8.check_block_split)."""
    if quant is not None and quant.method == FP8_METHOD:
        from llmctl.engine.layers.quantization.fp8 import check_block_split

        check_block_split(shape, tp, quant, expert_parallel)
        return
    if quant is not None:
        check_whole_groups(shape, quant.method, quant.group_size)
    if quant is None or tp == 1 or _splits_on_groups(shape, tp, quant.group_size, expert_parallel):
        return
    valid = valid_group_tp_sizes(shape, quant.group_size, expert_parallel)
    what = "GGUF blocks" if quant.method == "gguf" else f"--quantization {quant.method} groups"
    features = f"{shape.intermediate_size} MLP features and "
    hint = f"use tensor_parallel_size {', '.join(map(str, valid))}, or --pipeline-parallel-size"
    if shape.num_experts and expert_parallel:
        features = ""  # whole experts: only the attention is split
    elif shape.num_experts:
        features = f"{shape.expert_intermediate_size} features of each expert and "
        hint += ", or --enable-expert-parallel (whole experts per rank)"
    raise ConfigError(
        f"tensor_parallel_size={tp} would cut the {what} of {quant.group_size} weights: the "
        f"row-parallel layers split {features}"
        f"{sum(_row_split_sizes(shape, 1)[0])} attention features into "
        f"{' and '.join(str(s) for s in _row_split_sizes(shape, tp, expert_parallel))}",
        hint,
    )


def _architecture(hf_config) -> str | None:
    archs = getattr(hf_config, "architectures", None)
    if archs is None and isinstance(hf_config, dict):
        archs = hf_config.get("architectures")
    return archs[0] if archs else None
