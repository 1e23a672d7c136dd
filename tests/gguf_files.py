"""GGUF files written for the tests (gguf.GGUFWriter), and transformers' conversions of a GGUF
file's config and tokenizer: the oracle for what llmctl writes from the metadata
(engine/model_loader/gguf_config.py, gguf_tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmctl.engine.config.engine_config import checkpoint_dtype
from llmctl.engine.config.hf_config_view import HFConfigView
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.layers.rotary_embedding import rope_parameters
from llmctl.engine.model_loader.default_model import default_model_path
from llmctl.engine.model_loader.gguf import ensure_converted
from llmctl.engine.model_loader.gguf_file import read_gguf_metadata
from llmctl.engine.model_loader.source import CONFIG_VIEW_FILE
from llmctl.engine.tokenizer.gguf_tokenizer import TOKENIZER_ARRAYS


def transformers_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def transformers_config(gguf: Path):
    """The config as llmctl wrote it before (transformers' GGUF mapping + ModelShape's sizes)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from llmctl.engine.config.architectures import GGUF_ARCHITECTURES

    metadata, types = read_gguf_metadata(gguf)
    shape = ModelShape.from_gguf_metadata(metadata, tuple(n for n, _ in types))
    values = dict(load_gguf_checkpoint(str(gguf), return_tensors=False)["config"])
    model_type = values.pop("model_type")
    values.pop("_model_name_or_path", None)
    values.update(shape.hf_config_values())
    config = AutoConfig.for_model(model_type, **values)
    config.architectures = [GGUF_ARCHITECTURES[metadata["general.architecture"]]]
    config.dtype = "float32"
    return config


def assert_same_config(directory: Path, theirs) -> None:
    """What the engine reads from our view equals what it read from transformers' config, and
    transformers reading our config.json gets transformers' own config back."""
    from transformers import AutoConfig

    view = HFConfigView.from_json((directory / CONFIG_VIEW_FILE).read_text())
    assert ModelShape.from_hf_config(view) == ModelShape.from_hf_config(theirs)
    assert rope_parameters(view) == rope_parameters(theirs)
    assert checkpoint_dtype(view) == checkpoint_dtype(theirs)
    for name, value in vars(view).items():
        if name != "_config_class":
            assert value == getattr(theirs, name), name
    assert view._config_class == type(theirs).__name__

    reread = AutoConfig.from_pretrained(directory).to_dict()
    expected = theirs.to_dict()
    for key in ("transformers_version", "_name_or_path"):
        reread.pop(key, None)
        expected.pop(key, None)
    assert reread == expected


def write_gguf(path: Path, arch: str, metadata: dict, tensors: tuple[str, ...]) -> Path:
    """A GGUF file of `arch` ("{arch}" in a key stands for it) with these metadata values (the
    value type picked from the Python type: lists of str, int or float are arrays of string,
    int32 or float32) and tiny tensors of these names (the conversion reads their names only)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        key = key.replace("{arch}", arch)
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name in tensors:
        writer.add_tensor(name, np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_shape_keys(hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> dict:
    return {
        "{arch}.context_length": 512,
        "{arch}.embedding_length": hidden,
        "{arch}.block_count": 2,
        "{arch}.feed_forward_length": 2 * hidden,
        "{arch}.attention.head_count": heads,
        "{arch}.attention.head_count_kv": kv_heads,
        "{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "{arch}.rope.freq_base": 500000.0,
    }


def converted(gguf: Path, monkeypatch, cache: Path) -> Path:
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(cache))
    return ensure_converted(gguf)


SPM_CORPUS = (
    "the quick brown fox jumps over the lazy dog hello world héllo naïve café def return fib "
    "numbers 12 345 6789 they're don't stop it's"
)


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def sentencepiece_metadata() -> dict:
    """A small SentencePiece vocabulary as llama.cpp writes one: <unk> <s> </s>, the 256 byte
    tokens, pieces scored by frequency x length (no merges: they follow from the scores), a
    user-defined <think> and a control token."""
    counts: dict[str, int] = {}
    for word in SPM_CORPUS.split():
        word = "▁" + word
        for i in range(len(word)):
            for j in range(i + 1, min(len(word), i + 5) + 1):
                counts[word[i:j]] = counts.get(word[i:j], 0) + 1
    pieces = sorted(counts, key=lambda p: (-counts[p] * len(p), p))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    tokens += ["<think>", "<|ctrl|>"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4, 3]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }  # no add_bos_token: llama.cpp (and transformers) add BOS to a SentencePiece vocabulary


def byte_level_metadata(pre: str, size: int = 4000) -> dict:
    """The bundled SmolLM2 vocabulary's first `size` tokens and the merges among them, with a
    user-defined and a control token added, split as `pre` says."""
    metadata, _ = read_gguf_metadata(default_model_path(), TOKENIZER_ARRAYS)
    tokens = metadata["tokenizer.ggml.tokens"][:size] + ["<think>", "<|tool|>"]
    vocab = set(tokens)
    merges = [
        m
        for m in metadata["tokenizer.ggml.merges"]
        if all(p in vocab for p in m.split(" ")) and m.replace(" ", "") in vocab
    ]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": metadata["tokenizer.ggml.token_type"][:size] + [4, 3],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def random_tensors(arch: str, vocab: int, hidden: int, heads: int, kv_heads: int, ffn: int):
    """One decoder layer's random float32 tensors under llama.cpp's names."""
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    normal = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)  # noqa: E731
    near_one = lambda n: (1 + rng.standard_normal(n) * 0.1).astype(np.float32)  # noqa: E731
    if arch == "gpt2":
        return {
            "token_embd.weight": normal(vocab, hidden),
            "position_embd.weight": normal(1024, hidden),
            "blk.0.attn_norm.weight": near_one(hidden),
            "blk.0.attn_norm.bias": normal(hidden),
            "blk.0.attn_qkv.weight": normal(3 * hidden, hidden),
            "blk.0.attn_qkv.bias": normal(3 * hidden),
            "blk.0.attn_output.weight": normal(hidden, hidden),
            "blk.0.attn_output.bias": normal(hidden),
            "blk.0.ffn_norm.weight": near_one(hidden),
            "blk.0.ffn_norm.bias": normal(hidden),
            "blk.0.ffn_up.weight": normal(ffn, hidden),
            "blk.0.ffn_up.bias": normal(ffn),
            "blk.0.ffn_down.weight": normal(hidden, ffn),
            "blk.0.ffn_down.bias": normal(hidden),
            "output_norm.weight": near_one(hidden),
            "output_norm.bias": normal(hidden),
        }
    return {  # qwen2: biases on q, k and v
        "token_embd.weight": normal(vocab, hidden),
        "blk.0.attn_norm.weight": near_one(hidden),
        "blk.0.attn_q.weight": normal(heads * head_dim, hidden),
        "blk.0.attn_q.bias": normal(heads * head_dim),
        "blk.0.attn_k.weight": normal(kv_heads * head_dim, hidden),
        "blk.0.attn_k.bias": normal(kv_heads * head_dim),
        "blk.0.attn_v.weight": normal(kv_heads * head_dim, hidden),
        "blk.0.attn_v.bias": normal(kv_heads * head_dim),
        "blk.0.attn_output.weight": normal(hidden, heads * head_dim),
        "blk.0.ffn_norm.weight": near_one(hidden),
        "blk.0.ffn_gate.weight": normal(ffn, hidden),
        "blk.0.ffn_up.weight": normal(ffn, hidden),
        "blk.0.ffn_down.weight": normal(hidden, ffn),
        "output_norm.weight": near_one(hidden),
        "output.weight": normal(vocab, hidden),
    }
