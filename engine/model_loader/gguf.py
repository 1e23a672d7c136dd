"""GGUF files: their config and tokenizer, written once into a small cached directory.

The first load writes config.json (gguf_config.py) and the tokenizer with its chat template
(gguf_tokenizer.py) from the GGUF metadata into a directory that later loads (and every rank)
read, without importing transformers. The weights are not copied:
they are read in place from the memory-mapped GGUF file (gguf_file.py), quantized tensors staying
in their blocks. The cache key is the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from llmctl.engine import envs
from llmctl.engine.config.architectures import GGUF_ARCHITECTURES
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.errors import ConfigError, ModelLoadError, UnsupportedArchitectureError
from llmctl.engine.model_loader.gguf_moe import check_moe_tensors, moe_hf_name

# llama.cpp permutes the rows of q and k for these architectures; undo it.
_PERMUTED_QK = ("llama", "mistral")
_COMPLETE_MARKER = ".llmctl-complete"

ProgressFn = Callable[[int, int, str], None]
logger = logging.getLogger("llmctl")


def cache_root() -> Path:
    root = envs.LLMCTL_CACHE_DIR or os.path.join(os.path.expanduser("~"), ".cache", "llmctl")
    return Path(root) / "gguf"


def converted_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    # "config": the directory holds config and tokenizer only (older ones held float weights);
    # "-native": written by gguf_config.py and gguf_tokenizer.py (older ones by transformers).
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:config-native"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf_path.stem}-{digest}"


def ensure_converted(gguf_path: Path, progress: ProgressFn | None = None) -> Path:
    """Return the directory with `gguf_path`'s config.json and tokenizer, writing it if needed."""
    target = converted_dir(gguf_path)
    if (target / _COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Writing the config and tokenizer of %s into %s (once)", gguf_path.name, target)
    # Convert into a private directory, then rename: concurrent ranks never see half a model.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _convert(gguf_path, staging, progress)
        (staging / _COMPLETE_MARKER).write_text(str(gguf_path.resolve()))
        try:
            staging.rename(target)
        except OSError:
            if not (target / _COMPLETE_MARKER).exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out: Path, progress: ProgressFn | None) -> None:
    """Write config.json (+ its view) and the tokenizer from the file's metadata, without
    transformers (whose GGUF reader decodes the vocabulary value by value, and whose tokenizer
    converter builds it in Python: ~25 s for the bundled model, against ~0.3 s here)."""
    from llmctl.engine.model_loader.gguf_config import GGUFConfig
    from llmctl.engine.model_loader.gguf_file import read_gguf_metadata
    from llmctl.engine.tokenizer.gguf_tokenizer import TOKENIZER_ARRAYS, GGUFTokenizer

    del progress  # nothing here takes a noticeable time (the fallback below logs a line)
    metadata, types = read_gguf_metadata(gguf_path, TOKENIZER_ARRAYS)
    arch = str(metadata.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported",
            f"llmctl reads GGUF files of {', '.join(sorted(GGUF_ARCHITECTURES))}",
        )
    tensor_names = tuple(name for name, _ in types)
    try:
        shape = ModelShape.from_gguf_metadata(metadata, tensor_names)
    except ConfigError as exc:
        raise ModelLoadError(f"{gguf_path}: {exc.message}", exc.hint) from exc
    if shape.num_experts:  # stacked expert tensors only (gguf_moe.py)
        check_moe_tensors(gguf_path, arch, shape, tensor_names)
    GGUFConfig.from_metadata(metadata, tensor_names, shape, _config_tensors(gguf_path)).save(out)

    tokenizer = GGUFTokenizer.from_metadata(metadata)
    if tokenizer is None:
        # The weights still load: the model runs with skip_tokenizer_init, and without it
        # loading the tokenizer from the converted directory fails with a typed error.
        logger.warning("%s holds no tokenizer (no tokenizer.ggml.tokens)", gguf_path)
        return
    reason = tokenizer.unsupported()
    if reason is None:
        try:
            tokenizer.save(out)
            return
        except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception on bad data
            reason = f"a vocabulary the tokenizers library refused ({exc})"
    logger.info(
        "%s: converting its tokenizer with transformers (not built natively: %s); this "
        "takes tens of seconds, once",
        gguf_path.name,
        reason,
    )
    _convert_tokenizer_with_transformers(gguf_path, out)


def _config_tensors(gguf_path: Path) -> dict[str, list[float]]:
    """The small float tensors a config carries (Phi-3's LongRoPE factors), by name."""
    from llmctl.engine.model_loader.gguf_file import read_gguf_tensors

    wanted = ("rope_factors_long.weight", "rope_factors_short.weight")
    return {
        t.name: [float(x) for x in t.data.reshape(-1)]
        for t in read_gguf_tensors(gguf_path)
        if t.name in wanted and t.data is not None
    }


def _convert_tokenizer_with_transformers(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception on bad data
        logger.warning("%s holds no tokenizer transformers can read (%s)", gguf_path, exc)
    else:
        tokenizer.save_pretrained(out)


_GPT2_CONV1D = (
    "attn_qkv.weight",
    "attn_output.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)

_LLAMA_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Gemma 3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's deepseek2 (DeepSeek-V2/V3, Kimi-K2): multi-head latent attention. Newer files split
# kv_b_proj into attn_k_b (each head's rows transposed) and attn_v_b; gguf_file.py joins them.
_DEEPSEEK2_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}
# Architectures whose layer tensors are named apart from Llama's.
_ARCH_NAMES = {
    # Gemma 3's four norms per layer (its ffn_norm is the one before the MLP)
    "gemma3": _LLAMA_NAMES
    | {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    # Phi-3's fused projections, as its Hugging Face checkpoints hold them: [q | k | v] and
    # [gate | up] rows
    "phi3": _LLAMA_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # DeepSeek-V2/V3, Kimi-K2: multi-head latent attention
    "deepseek2": {**_LLAMA_NAMES, **_DEEPSEEK2_NAMES},
}
# llama.cpp's converter stores Gemma 3's norm weights plus one (its RMSNorm scales by 1 + w):
# the loader takes the one off again.
NORM_SHIFT = {"gemma3": 1.0}
# Tensors whose values the config carries (gguf_config.py), not the model.
_CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
_GPT2_NAMES = {
    "attn_norm": "ln_1",
    "ffn_norm": "ln_2",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}


def _hf_name(arch: str, name: str) -> str | None:
    """Hugging Face parameter name of a GGUF tensor (None for tensors HF does not store)."""
    base, _, kind = name.rpartition(".")  # kind: weight or bias
    if arch == "gpt2":
        top = {
            "token_embd": "transformer.wte",
            "position_embd": "transformer.wpe",
            "output_norm": "transformer.ln_f",
            "output": "lm_head",
        }
        layer_prefix, names = "transformer.h", _GPT2_NAMES
    else:
        top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
        layer_prefix, names = "model.layers", _ARCH_NAMES.get(arch, _LLAMA_NAMES)
    if base in top:
        return f"{top[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"{layer_prefix}.{parts[1]}.{names[parts[2]]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and (moe := moe_hf_name(arch, *parts[1:], kind)):
        return moe  # a mixture of experts' router, experts or shared expert
    if base in _CONFIG_TENSORS:
        return None  # the config's rope scaling (recomputed, or read into the config)
    raise ModelLoadError(
        f"unexpected tensor {name!r} in a GGUF file of architecture {arch!r}",
        "the file may come from a newer converter; name a Hugging Face directory instead",
    )


def _unpermute_rotary_rows(weights, num_heads: int):
    """Undo llama.cpp's interleaving of the rotary halves in each head's rows.

    weights: [num_heads * head_dim, hidden]; llama.cpp stored each head's rows as
    (head_dim/2, 2) pairs, Hugging Face as (2, head_dim/2) halves.
    """
    rows = weights.shape[0]
    half = rows // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)
