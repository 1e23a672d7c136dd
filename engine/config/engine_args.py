"""EngineArgs: everything a user may set, each option declared once, with its command line.

A field that is a command-line option carries an `OptionSpec` in its metadata (help, panel, vLLM
aliases such as -tp, bool style, the commands it belongs to), as vLLM's EngineArgs carries its
argparse options. Everything else is derived from these declarations: the options of `generate`
and `serve` (cli/engine_options.py), the options `plan` shares with the engine, and the argv that
gives EngineArgs keywords back to `llmctl serve` (`engine_args_to_argv`, used by the head server).
Adding an option is adding a field. `create_engine_config()` resolves the fields into the frozen
per-layer configs of engine/config/engine_config.py. Torch-free: `llmctl --help` and `llmctl plan`
import it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmctl.engine import envs
from llmctl.engine.config import options
from llmctl.engine.config.engine_config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEVICES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    check_layout,
    checkpoint_dtype,
    normalize_dtype,
    parse_layer_partition,
    resolve_max_model_len,
    resolve_max_num_batched_tokens,
)
from llmctl.engine.config.memory_profile import DEFAULT_CPU_KV_CACHE_SPACE_GIB
from llmctl.engine.config.model_shape import ModelShape
from llmctl.engine.config.options import (
    PARALLEL,
    PLANNER,
    SERVE,
    SERVER,
    EngineOption,
    option,
)
from llmctl.engine.errors import ConfigError
from llmctl.engine.layers.quantization.quant_config import (
    FLAG_METHODS,
    FP8_METHOD,
    RTN_GROUP_SIZE,
    QuantizationConfig,
    check_group_split,
    resolve_quantization,
)

logger = logging.getLogger("llmctl")

LOAD_FORMATS = ("auto", "dummy")  # vLLM's --load-format values llmctl has


@dataclass
class EngineArgs:
    """Everything a user may set, as LLM(...) keywords and CLI flags name it.

    Defaults are the per-layer configs' (as vLLM's EngineArgs takes them). The order of the
    option fields is their order in --help."""

    model: str | None = None
    served_model_name: str | None = option(
        "The model name clients send.",
        default=None,
        default_help="the model's name",
        panel=SERVER,
        commands=(SERVE,),
    )
    dtype: str = option(
        "auto, float32, bfloat16 or float16 (auto: bfloat16 on a CPU with native bfloat16, "
        "float32 on other CPUs and for quantized weights; on CUDA the checkpoint's, float16 for "
        "float32 checkpoints).",
        default="auto",
        show_default=True,
        commands=PLANNER,
    )
    max_model_len: int | None = option(
        "Longest prompt + completion, in tokens.",
        default=None,
        default_help="the model's",
        commands=PLANNER,
    )
    kv_cache_space_gib: float | None = option(
        "CPU: memory for the KV cache, in GiB.",
        default=None,
        default_help=f"{DEFAULT_CPU_KV_CACHE_SPACE_GIB:g}",
        commands=PLANNER,
    )
    gpu_memory_utilization: float = option(
        "CUDA: fraction of each GPU's memory the engine may use (weights, activations, KV cache: "
        "the KV cache gets what the others leave).",
        default=CacheConfig.gpu_memory_utilization,
        commands=PLANNER,
    )
    device: str = option(
        "auto, cuda or cpu.",
        default="auto",
        default_help="auto: cuda when torch sees a GPU, else cpu",
        commands=PLANNER,
    )
    quantization: str | None = option(
        "Quantization of a float checkpoint: int8 or int4 (weight-only, per-group of "
        f"{RTN_GROUP_SIZE} weights, round-to-nearest; activations stay float), or fp8 (128x128 "
        "blocks, round-to-nearest; on CUDA activations in FP8 per token and group of 128). A "
        "quantized GGUF file or an FP8 checkpoint runs in its own format without it.",
        default=None,
        default_help="none; a GGUF file's or FP8 checkpoint's own",
        commands=PLANNER,
    )
    load_format: str = option(
        "auto: read the checkpoint; dummy: random weights made on the device from the model's "
        "config.json alone (a directory without weights, or a catalog name such as "
        "Llama-3.1-8B: `llmctl plan --list-models`), to run a model's shape with no checkpoint "
        "(benchmarks). With no tokenizer files, prompts must be token ids.",
        default="auto",
    )
    enforce_eager: bool = option(
        "CUDA: run every step eagerly, without CUDA graphs (slower decode, less memory, no capture "
        "at start-up). The CPU always runs eagerly.",
        default=ModelConfig.enforce_eager,
        negatable=False,
    )
    block_size: int = option(
        "Tokens per KV cache block.", default=CacheConfig.block_size, commands=PLANNER
    )
    max_num_seqs: int = option(
        "Most requests per step.", default=SchedulerConfig.max_num_seqs, commands=PLANNER
    )
    max_num_batched_tokens: int | None = option(
        "Most tokens per step (longer prompts prefill in chunks).",
        default=None,
        default_help=f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, or --max-num-seqs if larger",
        commands=PLANNER,
    )
    enable_prefix_caching: bool = option(
        "Reuse the KV cache of shared prompt prefixes.", default=CacheConfig.enable_prefix_caching
    )
    tokenizer: str | None = option(
        "Directory to load the tokenizer from.", default=None, default_help="MODEL's directory"
    )
    skip_tokenizer_init: bool = option(
        "Load no tokenizer (the model directory needs no tokenizer files): prompts must be token "
        "ids, outputs carry token ids and no text, stop strings and chat are refused.",
        default=ModelConfig.skip_tokenizer_init,
        negatable=False,
        commands=(SERVE,),
    )
    stall_timeout: float = option(
        "Seconds the engine may have requests without completing a step (a deadlocked or "
        "stopped rank): then /health turns 503 naming the ranks, the requests in flight get "
        "errors and the workers are stopped. 0: never.",
        default=30.0,
        panel=SERVER,
        commands=(SERVE,),
    )
    restart_on_failure: bool = option(
        "When a worker dies or the engine stalls, stop every worker and start the engine again "
        "in this server (the requests in flight get errors), after 1, 2, 4, ... s.",
        default=False,
        panel=SERVER,
        commands=(SERVE,),
    )
    max_restarts: int = option(
        "Most engine restarts in the server's life with --restart-on-failure.",
        default=3,
        panel=SERVER,
        commands=(SERVE,),
    )
    tensor_parallel_size: int = option(
        "Ranks that split each layer (Megatron-LM tensor parallelism).",
        default=ParallelConfig.tensor_parallel_size,
        aliases=("-tp",),
        panel=PARALLEL,
        commands=PLANNER,
    )
    pipeline_parallel_size: int = option(
        "Pipeline stages that split the layers.",
        default=ParallelConfig.pipeline_parallel_size,
        aliases=("-pp",),
        panel=PARALLEL,
        commands=PLANNER,
    )
    distributed_executor_backend: str | None = option(
        "uni, mp or ray.",
        default=None,  # executor/base.py: choose_backend
        default_help="mp when this node has a device per rank, else ray; on the CPU, devices are "
        "LLMCTL_CPU_DEVICES or the cores",
        panel=PARALLEL,
    )
    pipeline_layer_partition: str | tuple[int, ...] | None = option(
        'Layers per pipeline stage, e.g. "10,11,9".',
        default=None,
        default_help="equal shares, the remainder before the last stage",
        value_type=str,
        panel=PARALLEL,
        commands=PLANNER,
    )
    enable_expert_parallel: bool = option(
        "Mixture-of-experts models: each rank of the tensor-parallel group holds whole experts "
        "(dealt out contiguously) instead of a slice of every expert; with "
        "--data-parallel-size, every replica's ranks share them (EP size = DP x TP).",
        default=ParallelConfig.enable_expert_parallel,
        negatable=False,
        panel=PARALLEL,
        commands=PLANNER,
    )
    nnodes: int = option(
        "Nodes the ranks span, on the mp backend without Ray: node r runs global ranks "
        "r*k..r*k+k-1 (k = tp*pp/nnodes, whole pipeline stages); start node 0 (the API) and "
        "the others with --headless.",
        default=ParallelConfig.nnodes,
        panel=PARALLEL,
    )
    node_rank: int = option(
        "This node's rank, 0 to --nnodes - 1.", default=ParallelConfig.node_rank, panel=PARALLEL
    )
    master_addr: str | None = option(
        "Node 0's address, which every node reaches: torch.distributed's rendezvous at "
        "--master-port, the executor's at --master-port + 1.",
        default=None,
        default_help="required with --nnodes > 1",
        panel=PARALLEL,
    )
    master_port: int = option(
        "Node 0's rendezvous port (and the port after it).",
        default=ParallelConfig.master_port,
        panel=PARALLEL,
    )
    rendezvous_timeout: float = option(
        "Seconds the nodes wait for each other to join (and a data-parallel head for a joined "
        "replica's engine to be built).",
        default=ParallelConfig.rendezvous_timeout,
        panel=PARALLEL,
    )
    cluster_secret_file: str | None = option(
        "A file holding the cluster's secret (the same on every node): nodes and data-parallel "
        "replicas prove to each other that they hold it when they join (HMAC-SHA256 over fresh "
        "nonces, both ways), before anything they send is read. Needed with --nnodes > 1 or "
        "replicas on other nodes.",
        default=None,
        default_help="$LLMCTL_CLUSTER_SECRET",
        panel=PARALLEL,
    )
    insecure_join: bool = option(
        "Let nodes join without a cluster secret. RISK: nodes exchange pickled Python objects, "
        "so anyone who reaches node 0's (or the data-parallel head's) ports, or poses as node 0, "
        "runs code on the nodes; only for a network no one else reaches.",
        default=False,
        negatable=False,
        panel=PARALLEL,
    )
    data_parallel_size: int = option(
        "Engine replicas, each of tp x pp ranks with its own workers and KV cache; requests go "
        "to the least busy replica, or to the one that cached their prefix.",
        default=ParallelConfig.data_parallel_size,
        aliases=("-dp",),
        panel=PARALLEL,
        commands=PLANNER,
    )
    # vLLM's multi-node data parallel (engine/dp/placement.py): whole replicas on several
    # nodes, driven by the head's router (engine/dp/join_server.py).
    data_parallel_size_local: int | None = option(
        "Multi-node data parallel: replicas on this node (the head runs replicas 0 to L-1; 0: "
        "the API server alone); the other nodes run the rest with --headless.",
        default=None,
        default_help="--data-parallel-size",
        panel=PARALLEL,
        commands=(SERVE,),
    )
    data_parallel_start_rank: int | None = option(
        "Multi-node data parallel, on a --headless node: the rank of its first replica.",
        default=None,
        default_help="0",
        panel=PARALLEL,
        commands=(SERVE,),
    )
    data_parallel_address: str | None = option(
        "Multi-node data parallel: the head node's address, which every node reaches.",
        default=None,
        default_help="required with replicas on other nodes",
        panel=PARALLEL,
        commands=(SERVE,),
    )
    data_parallel_rpc_port: int | None = option(
        "Multi-node data parallel: the head's port where replicas of other nodes join.",
        default=None,
        default_help="29550",
        panel=PARALLEL,
        commands=(SERVE,),
    )
    headless: bool = option(
        "Run this node's ranks, no API server: every node but node 0. Runs until node 0 ends "
        "the group. With --data-parallel-address: run this node's replicas for the head.",
        default=False,
        negatable=False,
        panel=PARALLEL,
        commands=(SERVE,),
    )
    num_gpu_blocks_override: int | None = option(
        "Use this many KV-cache blocks instead of what the memory allows (vLLM's flag): to pin "
        "the capacity, or to make preemption happen on purpose.",
        default=None,
        default_help="what --kv-cache-space-gib or --gpu-memory-utilization holds",
    )
    gguf_dequantize: bool = option(
        "Load a quantized GGUF file's weights dequantized to the float dtype instead of running "
        "its packed blocks: the reference its quantized path is checked against (more memory, "
        "slower).",
        default=False,
    )
    seed: int = ModelConfig.seed
    max_concurrent_batches: int | None = None  # default: pipeline_parallel_size

    def __post_init__(self) -> None:
        # Checks that need no file and no torch, so a typo fails before anything loads.
        normalize_dtype(self.dtype)
        if self.device not in DEVICES:
            raise ConfigError(f"unknown device {self.device!r}", "use --device auto, cpu or cuda")
        CacheConfig(
            block_size=self.block_size,
            kv_cache_space_gib=self.kv_cache_space_gib,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )
        SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or self.max_num_seqs,
        )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
                "allow a positive token budget per step",
            )
        parallel = self.create_parallel_config()
        placement = self.data_parallel_placement()  # typed errors for the multi-node DP flags
        if parallel.expert_parallel_across_dp:
            from llmctl.engine.dp.lockstep import check_engine_args

            check_engine_args(self, placement)
        if parallel.nnodes > 1 or placement.multi_node:  # refused without a secret: typed
            from llmctl.engine.distributed.join import ClusterSecret

            ClusterSecret.load(
                self.cluster_secret_file,
                self.insecure_join,
                needed_by=f"--nnodes {self.nnodes}"
                if parallel.nnodes > 1
                else "data parallel across nodes (--data-parallel-address)",
            )
        if self.headless and self.node_rank == 0 and not placement.headless:
            raise ConfigError(
                "--headless runs no API server, but node rank 0 serves it",
                "drop --headless on node 0; give the other nodes --node-rank 1 to "
                f"{max(1, self.nnodes - 1)}",
            )
        if self.node_rank > 0 and not self.headless:
            raise ConfigError(
                f"node rank {self.node_rank} runs ranks for node 0, which serves the API",
                "add --headless (llmctl serve ... --headless) on every node but node 0",
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(
                f"max_model_len must be at least 1, got {self.max_model_len}",
                "pass a positive --max-model-len",
            )
        if not 0 <= self.stall_timeout < float("inf"):
            raise ConfigError(
                f"stall_timeout must be a non-negative number of seconds, got {self.stall_timeout}",
                "pass --stall-timeout 30 (0: never declare the engine stalled)",
            )
        if self.max_restarts < 0:
            raise ConfigError(
                f"max_restarts must be non-negative, got {self.max_restarts}",
                "pass --max-restarts 3 (0: never restart)",
            )
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"unknown load_format {self.load_format!r}",
                f"use --load-format {' or '.join(LOAD_FORMATS)}",
            )
        if self.quantization is not None and self.quantization not in FLAG_METHODS:
            raise ConfigError(
                f"unknown quantization {self.quantization!r}",
                f"use --quantization {' or '.join(FLAG_METHODS)}, or leave it out",
            )

    def create_engine_config(self, progress=None) -> EngineConfig:
        from llmctl.engine import platform
        from llmctl.engine.model_loader.source import resolve_model
        from llmctl.engine.models.registry import check_architecture

        if self.headless and not self.data_parallel_placement().headless:
            raise ConfigError(
                "headless=True starts no engine: it runs a node's ranks for node 0's engine",
                "on nodes 1 to N-1 run `llmctl serve ... --node-rank R --headless`; drop "
                "headless here",
            )
        dtype = normalize_dtype(self.dtype)
        device = platform.resolve_device(self.device)
        device_config = DeviceConfig(device=device)
        source = resolve_model(self.model, progress, self.load_format)
        hf_config = source.load_hf_config()
        architecture = source.architecture(hf_config)
        check_architecture(architecture)
        shape = ModelShape.from_hf_config(hf_config, architecture)
        layer_partition = parse_layer_partition(
            self.pipeline_layer_partition or envs.LLMCTL_PP_LAYER_PARTITION
        )
        quantization = self._check_split(shape, layer_partition, source.gguf_file, hf_config)
        if quantization is not None and quantization.method == FP8_METHOD:
            platform.check_fp8(device)
        resolved_dtype = platform.resolve_dtype(dtype, device, checkpoint_dtype(hf_config))
        max_model_len = resolve_max_model_len(shape, self.max_model_len)
        model_config = ModelConfig(
            model=self.model or "",
            path=source.path,
            hf_config=hf_config,
            architecture=architecture,
            shape=shape,
            dtype=resolved_dtype,
            max_model_len=max_model_len,
            tokenizer=self.tokenizer or source.path,
            served_model_name=self.served_model_name or source.display_name,
            seed=self.seed,
            skip_tokenizer_init=self._skip_tokenizer_init(source.path),
            enforce_eager=bool(self.enforce_eager),
            quantization=quantization,
            gguf_file=source.gguf_file or "",
            load_format=self.load_format,
            int8_activations=platform.int8_activations(dtype, device),
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_space_gib=self.kv_cache_space_gib,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=resolve_max_num_batched_tokens(
                self.max_num_batched_tokens, self.max_num_seqs
            ),
            max_model_len=max_model_len,
            max_concurrent_batches=self.max_concurrent_batches or self.pipeline_parallel_size,
        )
        parallel_config = self.create_parallel_config(layer_partition)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            device_config=device_config,
        )

    def _check_split(
        self,
        shape: ModelShape,
        layer_partition: tuple[int, ...] | None,
        gguf_file: str | None,
        hf_config,
    ) -> QuantizationConfig | None:
        """The layout and the weights' quantization, checked against the model's shape (typed
        errors naming the sizes that divide); returns the quantization."""
        check_layout(
            shape,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            layer_partition,
            self.enable_expert_parallel,
        )
        quantization = self._quantization(gguf_file, hf_config)
        ep_size = self.tensor_parallel_size * (
            self.data_parallel_size if self.enable_expert_parallel else 1
        )
        if self.enable_expert_parallel and ep_size > 1:
            from llmctl.engine.distributed.partition import describe_expert_placement

            across = f" (EP size {ep_size} = DP x TP)" if self.data_parallel_size > 1 else ""
            logger.info(
                "Expert parallel%s: %s",
                across,
                describe_expert_placement(shape.num_experts, ep_size),
            )
        check_group_split(
            shape, self.tensor_parallel_size, quantization, self.enable_expert_parallel
        )
        return quantization

    def _skip_tokenizer_init(self, path: str) -> bool:
        """skip_tokenizer_init as given; with dummy weights, also when the model's directory
        holds no tokenizer (a catalog name's): prompts are then token ids."""
        if self.skip_tokenizer_init:
            return True
        if self.load_format != "dummy" or self.tokenizer is not None:
            return False
        from llmctl.engine.model_loader.source import has_tokenizer_files

        if has_tokenizer_files(path):
            return False
        logger.info("No tokenizer in %s: prompts must be token ids (skip_tokenizer_init)", path)
        return True

    def create_parallel_config(
        self, layer_partition: tuple[int, ...] | None = None
    ) -> ParallelConfig:
        """The layout and, across nodes, this node's place (all a --headless node needs)."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            pipeline_layer_partition=layer_partition,
            enable_expert_parallel=bool(self.enable_expert_parallel),
            data_parallel_size=self.data_parallel_size,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            rendezvous_timeout=self.rendezvous_timeout,
            cluster_secret_file=self.cluster_secret_file,
            insecure_join=bool(self.insecure_join),
        )

    def data_parallel_placement(self):
        """Which data-parallel replicas run on this node (engine/dp/placement.py)."""
        from llmctl.engine.dp.placement import DPPlacement

        # --headless is the data-parallel one when a data-parallel flag comes with it (else it
        # is an --nnodes node's)
        dp_flags = (
            self.data_parallel_size > 1
            or self.data_parallel_size_local is not None
            or self.data_parallel_address is not None
        )
        return DPPlacement(
            size=self.data_parallel_size,
            size_local=self.data_parallel_size_local,
            start_rank=self.data_parallel_start_rank,
            address=self.data_parallel_address,
            rpc_port=self.data_parallel_rpc_port,
            headless=self.headless and dp_flags and self.nnodes == 1,
            nnodes=self.nnodes,
        )

    def _quantization(self, gguf_file: str | None, hf_config=None) -> QuantizationConfig | None:
        """--quantization, or a GGUF file's or FP8 checkpoint's own (refusing an integer scheme
        on an already quantized file)."""
        if not gguf_file:
            checkpoint = QuantizationConfig.for_checkpoint(hf_config)
            return resolve_quantization(self.quantization, None, checkpoint)
        gguf_config = None
        if gguf_file:
            from llmctl.engine.model_loader.gguf_file import gguf_tensor_types

            gguf_config = QuantizationConfig.for_gguf(gguf_tensor_types(gguf_file))
            if self.gguf_dequantize or self.load_format == "dummy":
                return resolve_quantization(self.quantization, None)  # float weights
        return resolve_quantization(self.quantization, gguf_config)


def cli_options(
    command: str | None = None, args_class: type = EngineArgs
) -> tuple[EngineOption, ...]:
    """The command-line options of EngineArgs (or a dataclass extending it) for `command`."""
    return options.cli_options(command, args_class)


def engine_args_to_argv(
    kwargs: Mapping[str, Any], args_class: type = EngineArgs, *, aliases: bool = False
) -> list[str]:
    """The flags that give these EngineArgs keywords to `llmctl serve` (or `generate`)."""
    return options.args_to_argv(kwargs, args_class, aliases=aliases)


def engine_default(name: str) -> Any:
    """EngineArgs' default for a field (for the planner's options that mirror the engine's)."""
    return _FIELDS[name].default


_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
