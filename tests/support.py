"""Test support: the tiny model families the tests build, and how they are built."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

VOCAB = 49152  # the SmolLM2 tokenizer's size; tiny models share that tokenizer


def tiny_configs() -> dict:
    from transformers import (
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        OPTConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    return {
        "llama": LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256
        ),
        # A sliding window shorter than prompt + output, so the window is exercised.
        "mistral": MistralConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=256,
            sliding_window=24,
        ),
        "qwen2": Qwen2Config(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        ),
        "gpt2": GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=4, n_head=4),
        "opt": OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
        ),
        # opt-350m's shape: narrower embedding (project_in/out), LayerNorm after each block.
        "opt-350m-style": OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
        ),
        # 9 heads / 3 KV heads like SmolLM2: the uneven tensor-parallel case.
        "llama-9-heads": LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=72,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        ),
        # Mixtures of experts (tests/engine/test_moe.py): 8 experts of 32 features, so expert
        # parallelism deals them 4 + 4 on 2 ranks and 3 + 3 + 2 on 3.
        "mixtral": MixtralConfig(
            **_MOE_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2
        ),
        # A shared expert, top-2 without renormalization (norm_topk_prob False, the default),
        # and layer 1 dense (mlp_only_layers).
        "qwen2-moe": Qwen2MoeConfig(
            **{**_MOE_COMMON, "num_hidden_layers": 3},
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=6,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),
        # q/k norm, top-3 renormalized.
        "qwen3-moe": Qwen3MoeConfig(
            **_MOE_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
    }


def routed_configs() -> dict:
    """DeepSeek-V2/V3 and GLM-4.5, tiny (tests/engine/test_deepseek_glm.py): layer 0 dense, layer 1
    a mixture of 8 experts with shared experts, 4 heads. "deepseek-v3": low-rank queries
    (q_lora_rank), YaRN with mscale, sigmoid routing over 2 of 4 groups with a correction bias
    and a scaling factor; "deepseek-v3-no-q-lora": q_proj, plain rotary on unpaired halves
    (rope_interleave false), one group; "deepseek-v2": softmax routing, group_limited_greedy;
    "glm4-moe": QKV bias, q/k norm, half the head rotary, grouped sigmoid routing."""
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        max_position_embeddings=256,
    )
    mla = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24)
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    return {
        "deepseek-v3": DeepseekV3Config(
            **common, **mla, q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, rope_parameters=yarn,
        ),
        "deepseek-v3-no-q-lora": DeepseekV3Config(
            **common, **mla, q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1,
            rope_interleave=False,
        ),
        "deepseek-v2": DeepseekV2Config(
            **common, **mla, q_lora_rank=48, n_shared_experts=2, n_group=4, topk_group=2,
            topk_method="group_limited_greedy", routed_scaling_factor=2.0,
        ),
        "glm4-moe": Glm4MoeConfig(
            **common, num_key_value_heads=2, head_dim=32, n_shared_experts=1, n_group=2,
            topk_group=1, attention_bias=True, use_qk_norm=True, routed_scaling_factor=1.5,
        ),
    }  # fmt: skip


ROUTED_FAMILIES = ["deepseek-v3", "deepseek-v3-no-q-lora", "deepseek-v2", "glm4-moe"]


def spread_routers(model) -> None:
    """Routers that choose decisively: transformers initializes a router's weights with std 0.02
    and DeepSeek's correction bias with zeros, so on a random model every expert scores about
    the same and a rounding difference could pick another; std 0.5, a bias in [-0.1, 0.1]."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape, generator=g) * 0.2 - 0.1)


def mixtral_with_experts_of(features: int):
    """The tiny Mixtral config with experts of `features` features (64: whole groups or blocks
    of 32 on each of two tensor-parallel ranks)."""
    config = tiny_configs()["mixtral"]
    config.intermediate_size = features
    return config


_MOE_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MOE_FAMILIES = ["mixtral", "qwen2-moe", "qwen3-moe"]
FAMILIES = ["llama", "mistral", "qwen2", "gpt2", "opt", "opt-350m-style"]
# Issue 34's families (tests/engine/test_new_families.py): each tiny config exercises what its
# family adds; windows of 12 tokens, so 8 prompts of up to 40 tokens plus 24 generated pass them
# and free sliding blocks of 16.
NEW_FAMILIES = ["qwen3", "gemma3", "phi3", "gpt-oss"]


def new_family_configs() -> dict:
    from transformers import Gemma3TextConfig, GptOssConfig, Phi3Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return {
        "qwen3": Qwen3Config(**common, intermediate_size=128, num_hidden_layers=4),
        # Sliding, sliding, global (x2); scores scaled by 24 ** -0.5; the global layers' rope
        # linearly scaled from base 1e6, the local ones at base 1e4 (as Gemma-3-27B's).
        "gemma3": Gemma3TextConfig(
            **common,
            intermediate_size=128,
            num_hidden_layers=6,
            query_pre_attn_scalar=24,
            sliding_window=12,
            sliding_window_pattern=3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        # LongRoPE past 32 tokens (prompts of 40 start long, shorter ones cross it while they
        # generate), rotating half of each head (Phi-4-mini's partial rotary).
        "phi3": Phi3Config(
            **common,
            intermediate_size=128,
            num_hidden_layers=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [30.0, 60.0, 90.0, 200.0],
                "original_max_position_embeddings": 32,
            },
        ),
        # Sliding and full alternating, sinks, 8 experts of 32 features (top-2), YaRN.
        "gpt-oss": GptOssConfig(
            **common,
            intermediate_size=32,
            num_hidden_layers=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=12,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    }


def _perturb(model) -> None:
    """Give the weights a random init leaves constant (norms at 1 or 0, zero biases, small
    sinks) random values, so a test sees each of them used: seeded, in place."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=g) * 0.2)
            elif name.endswith("bias") or name.endswith("sinks"):
                scale = 1.0 if "sinks" in name else 0.1
                param.copy_(torch.randn(param.shape, generator=g) * scale)


def generate_in_new_thread(llm, prompts, params) -> list:
    """llm.generate(prompts, params), run in a new thread. Triton's interpreter makes millions of
    short Python calls, and at the depth pytest calls a test from they can cross the end of one of
    CPython's 16 KiB frame-stack chunks (3.11 here): each call then maps a fresh chunk and unmaps
    it on return, which took 2-3x the time (half of it in mmap/munmap). A new thread's frames
    start at the bottom of its first chunk, and the engine's deepest (about 11 KiB) fit."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(llm.generate, prompts, params, use_tqdm=False).result()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids, one per length, the same for the same seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


MAX_GAP = 1e-3  # the reference's logit gap below which a greedy choice may differ


def assert_same_greedy(native, reference) -> None:
    """Same tokens, or a first difference where the reference (run with logprobs=5) barely
    preferred its token: its logit gap there below MAX_GAP (printed)."""
    for got, want in zip(native, reference, strict=True):
        got, want = got.outputs[0], want.outputs[0]
        if got.token_ids == want.token_ids:
            continue
        pairs = enumerate(zip(got.token_ids, want.token_ids, strict=True))
        pos = next(i for i, (a, b) in pairs if a != b)
        ref = want.logprobs[pos]
        chosen, other = want.token_ids[pos], got.token_ids[pos]
        assert other in ref, f"position {pos}: token {other} is not in the reference's top 5"
        gap = ref[chosen].logprob - ref[other].logprob
        print(f"first differing position {pos}: logit gap {gap:.2e}")
        assert gap < MAX_GAP, f"position {pos}: logit gap {gap:.2e} >= {MAX_GAP}"


def token_ids(outputs) -> list[list[int]]:
    """The first completion's token ids of each RequestOutput."""
    return [o.outputs[0].token_ids for o in outputs]


# ChatML spelled out in bytes (the byte-level tokenizer has no special tokens but its EOS), so
# that the chat endpoints answer on the tiny models without the bundled SmolLM2's tokenizer
BYTE_LEVEL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer():
    """A byte-level tokenizer with no merges (ids 0-255: bytes, 256: <|endoftext|>) and a
    ChatML chat template, built in memory: the tiny models' tokenizer where the bundled SmolLM2
    is not installed. Token ids past 256 decode to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's printable stand-ins for the 256 bytes: printable Latin-1 maps to itself, the rest
    # to the characters from U+0100 on, in byte order.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    vocab = {c: i for i, c in enumerate(chars)} | {"<|endoftext|>": 256}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        chat_template=BYTE_LEVEL_CHAT_TEMPLATE,
    )


class TinyModels:
    """Builds (once per session) a tiny random model per family: seeded, saved with its
    tokenizer, and kept in memory as the Hugging Face oracle."""

    def __init__(self, root: Path, tokenizer) -> None:
        self.root = root
        self.tokenizer = tokenizer
        self._cache: dict[tuple, tuple[Path, object]] = {}

    def get(self, family: str, *, save: str = "safetensors") -> tuple[Path, object]:
        key = (family, save)
        if key not in self._cache:
            import torch
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            configs = {**tiny_configs(), **routed_configs(), **new_family_configs()}
            model = AutoModelForCausalLM.from_config(configs[family]).eval()
            if family in ROUTED_FAMILIES:
                spread_routers(model)
            if family in NEW_FAMILIES:
                _perturb(model)
            path = self.root / f"{family}-{save}"
            if save == "safetensors":
                model.save_pretrained(path)
            elif save == "sharded":
                model.save_pretrained(path, max_shard_size="2MB")
            elif save == "bin":
                path.mkdir(parents=True)
                model.config.architectures = [type(model).__name__]
                model.config.save_pretrained(path)
                torch.save(model.state_dict(), path / "pytorch_model.bin")
            else:
                raise ValueError(save)
            self.tokenizer.save_pretrained(path)
            self._cache[key] = (path, model)
        return self._cache[key]

    def path(self, family: str, **kw) -> Path:
        return self.get(family, **kw)[0]


def _proc_stat(pid: str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def live_pids(*, parent: int | None = None, session: int | None = None) -> set[int]:
    """Live (not zombie) processes with this parent, or in this session."""
    import os

    found = set()
    for entry in os.listdir("/proc"):
        fields = _proc_stat(entry) if entry.isdigit() else None
        if fields is None or fields[0] == "Z":
            continue
        if (parent is not None and int(fields[1]) == parent) or (
            session is not None and int(fields[3]) == session
        ):
            found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    fields = _proc_stat(str(pid))
    return fields is not None and fields[0] != "Z"


def free_gpu_memory() -> None:
    """Give what this process's dead tensors hold back to the driver: an engine started next, here
    or in another process, sizes its KV cache from what is free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def default_signals() -> None:
    """preexec_fn for a process that a test interrupts, as a terminal would: SIGINT, SIGHUP and
    SIGTERM back to their defaults. A suite started under `nohup` or as a background job (`&`)
    runs with SIGHUP and SIGINT ignored, which every child inherits: Python then installs no
    KeyboardInterrupt handler and bash cannot trap SIGHUP, so the signal the test sends would
    be lost and the test would time out."""
    import signal

    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


class Streams:
    """Streaming completions, each read to its end in a thread of its own. `wait_streaming()`
    returns once every stream has received a chunk: its request is then running in the engine,
    which a poll of /metrics can miss (a tiny model's 200 tokens take 0.3 s, and on a busy
    machine one /metrics round trip meanwhile can take as long). `join()` gives each stream's
    outcome: ("finished", text, finish_reason) or ("error", message)."""

    def __init__(self, client_factory, requests: list[dict]) -> None:
        import threading

        self.outcomes: list[tuple | None] = [None] * len(requests)
        self._first = [threading.Event() for _ in requests]
        self._threads = [
            threading.Thread(target=self._read, args=(i, client_factory, kw), daemon=True)
            for i, kw in enumerate(requests)
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, i: int, client_factory, kw: dict) -> None:
        import openai

        text, finish = "", None
        try:
            for chunk in client_factory().completions.create(stream=True, **kw):
                self._first[i].set()
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            self.outcomes[i] = ("finished", text, finish)
        except openai.APIError as exc:
            self.outcomes[i] = ("error", str(exc))
        finally:
            self._first[i].set()

    def wait_streaming(self, timeout: float = 60) -> None:
        import time

        deadline = time.monotonic() + timeout
        for i, first in enumerate(self._first):
            assert first.wait(max(0.0, deadline - time.monotonic())), f"stream {i} sent nothing"
            outcome = self.outcomes[i]
            assert outcome is None or outcome[0] != "error", f"stream {i} failed: {outcome}"

    def join(self, timeout: float = 120) -> list[tuple]:
        import time

        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a stream hangs"  # none hangs
        return list(self.outcomes)
