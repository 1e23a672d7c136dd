"""Worker: one rank. Owns its device, its slice of the model, its KV cache and a ModelRunner.

Executors drive workers only through the methods below (collective_rpc by name), whether the
worker lives in this process, a child process or a Ray actor.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from llmctl.engine.config import DEFAULT_CPU_KV_CACHE_SPACE_GIB, EngineConfig
from llmctl.engine.distributed.parallel_state import get_pp_group
from llmctl.engine.distributed.partition import pipeline_shard
from llmctl.engine.model_runner_output import ModelRunnerOutput
from llmctl.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger("llmctl")


class Worker:
    def __init__(self, engine_config: EngineConfig, rank: int = 0, local_rank: int = 0) -> None:
        self.config = dataclasses.replace(
            engine_config,
            parallel_config=dataclasses.replace(engine_config.parallel_config, rank=rank),
        )
        self.rank = rank
        self.local_rank = local_rank
        self.model_runner = None

    def init_device(self) -> None:
        from llmctl.engine import platform

        if self.config.device_config.device == "cpu":
            platform.tune_cpu_allocator()
        else:
            torch.cuda.set_device(self.local_rank)

    def load_model(self, progress=None) -> None:
        from llmctl.engine.model_loader.loader import load_model
        from llmctl.engine.worker.model_runner import ModelRunner

        mc = self.config.model_config
        pp = get_pp_group()
        shard = pipeline_shard(
            mc.num_layers,
            pp.rank_in_group,
            pp.world_size,
            self.config.parallel_config.pipeline_layer_partition,
        )
        model = load_model(mc, shard, self.config.device_config.device, progress)
        self.model_runner = ModelRunner(self.config, model)

    def determine_num_available_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if self.config.device_config.device == "cpu":
            space = cache.kv_cache_space_gib or DEFAULT_CPU_KV_CACHE_SPACE_GIB
            return int(space * (1 << 30)) // per_block
        free, total = torch.cuda.mem_get_info()
        used = total - free
        budget = total * cache.gpu_memory_utilization - used
        return max(int(budget) // per_block, 0)

    def kv_cache_bytes_per_block(self) -> int:
        return self.model_runner.kv_cache_bytes_per_block()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def check_health(self) -> bool:
        return True
