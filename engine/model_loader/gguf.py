"""GGUF files: their config and tokenizer, written once into a small cached directory.

Parsing a GGUF file's metadata takes seconds (its tokenizer arrays are read value by value), so
the first load writes config.json and the tokenizer (with its chat template) from the GGUF
metadata into a directory that later loads (and every rank) read. The weights are not copied:
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

from llmctl.engine.errors import ConfigError, ModelLoadError, UnsupportedArchitectureError
from llmctl.engine.model_loader.gguf_moe import check_moe_tensors, moe_config_values, moe_hf_name
from llmctl.engine.model_shape import GGUF_ARCHITECTURES, GGUF_TOKENS, ModelShape

# llama.cpp permutes the rows of q and k for these architectures; undo it.
_PERMUTED_QK = ("llama", "mistral")
_COMPLETE_MARKER = ".llmctl-complete"

ProgressFn = Callable[[int, int, str], None]
logger = logging.getLogger("llmctl")


def cache_root() -> Path:
    root = os.environ.get("LLMCTL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "llmctl"
    )
    return Path(root) / "gguf"


def converted_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    # "config": the directory holds config and tokenizer only (older ones held float weights).
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:config"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{gguf_path.stem}-{digest}"


def ensure_converted(gguf_path: Path, progress: ProgressFn | None = None) -> Path:
    """Return the directory with `gguf_path`'s config.json and tokenizer, writing it if needed."""
    target = converted_dir(gguf_path)
    if (target / _COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
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


def gguf_metadata(reader) -> dict:
    """A GGUFReader's key-value metadata as plain values; arrays (the tokenizer's vocabulary)
    by their length, since decoding them value by value takes seconds."""
    metadata = {}
    for key, field in reader.fields.items():
        if key == GGUF_TOKENS or (len(field.types) > 1 and key.startswith("tokenizer.")):
            metadata[key] = len(field.data)
            continue
        try:
            metadata[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field the reader cannot decode is left out
            continue
    return metadata


def gguf_shape(reader) -> ModelShape:
    """The model's shape from a GGUFReader, through ModelShape's one table of GGUF keys."""
    return ModelShape.from_gguf_metadata(
        gguf_metadata(reader), tuple(t.name for t in reader.tensors)
    )


def read_gguf_shape(path: Path) -> ModelShape:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueError/KeyError on bad files
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({exc})",
            "check that the download finished, or name another model",
        ) from exc
    return gguf_shape(reader)


def _convert(gguf_path: Path, out: Path, progress: ProgressFn | None) -> None:
    import gguf
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        arch = str(reader.fields["general.architecture"].contents())
    except Exception as exc:  # the gguf package raises bare ValueError/KeyError on bad files
        raise ModelLoadError(
            f"{gguf_path} is not a readable GGUF file ({exc})",
            "check that the download finished, or name another model",
        ) from exc
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported",
            f"llmctl reads GGUF files of {', '.join(sorted(GGUF_ARCHITECTURES))}",
        )
    try:
        shape = gguf_shape(reader)
    except ConfigError as exc:
        raise ModelLoadError(f"{gguf_path}: {exc.message}", exc.hint) from exc
    if shape.num_experts:  # stacked expert tensors only (gguf_moe.py)
        check_moe_tensors(gguf_path, arch, shape, tuple(t.name for t in reader.tensors))
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    config_dict = dict(parsed["config"])
    model_type = config_dict.pop("model_type", arch)
    config_dict.pop("_model_name_or_path", None)
    # The sizes come from ModelShape's GGUF table (the planner reads the same); transformers'
    # mapping supplies the rest (rope, norm epsilon, special tokens).
    config_dict.update(shape.hf_config_values())
    config_dict.update(moe_config_values(arch, shape))  # {} for a dense model
    model_type = config_dict.pop("model_type", model_type)
    config = AutoConfig.for_model(model_type, **config_dict)
    config.architectures = [GGUF_ARCHITECTURES.get(model_type, shape.architecture)]
    config.dtype = "float32"
    config.save_pretrained(out)
    from llmctl.engine.model_loader.source import write_config_view

    write_config_view(config, out)  # later loads read this, without importing transformers

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        # The weights still convert: the model runs with skip_tokenizer_init, and without it
        # loading the tokenizer from the converted directory fails with a typed error.
        logger.warning("%s holds no tokenizer transformers can read (%s)", gguf_path, exc)
    else:
        tokenizer.save_pretrained(out)

    del progress  # writing the config takes no noticeable time after the parse


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
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
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
        layer_prefix, names = "model.layers", _LLAMA_NAMES
    if base in top:
        return f"{top[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"{layer_prefix}.{parts[1]}.{names[parts[2]]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and (moe := moe_hf_name(arch, *parts[1:], kind)):
        return moe  # a mixture of experts' router, experts or shared expert
    if base == "rope_freqs":
        return None  # recomputed from the config's rope scaling
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
