"""Worker: one rank. Owns its device, its slice of the model, its KV cache and a ModelRunner.

Executors drive workers only through the methods below (collective_rpc by name), whether the
worker lives in this process, a child process or a Ray actor. Pipeline stages pass hidden states
here: a stage receives them from the previous stage's rank with the same tp_rank and sends its own
to the next one, in the order the batches were scheduled.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource

import torch

from llmctl.engine.config import DEFAULT_CPU_KV_CACHE_SPACE_GIB, EngineConfig
from llmctl.engine.distributed import parallel_state, ranks
from llmctl.engine.distributed.partition import pipeline_shard
from llmctl.engine.model_runner_output import ModelRunnerOutput
from llmctl.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger("llmctl")


class Worker:
    def __init__(
        self,
        engine_config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = dataclasses.replace(
            engine_config,
            parallel_config=dataclasses.replace(engine_config.parallel_config, rank=rank),
        )
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.model_runner = None
        self._pending_sends: list = []

    def init_device(self) -> None:
        from llmctl.engine import platform

        pc = self.config.parallel_config
        device = self.config.device_config.device
        if device == "cpu":
            platform.tune_cpu_allocator()
        else:
            torch.cuda.set_device(self.local_rank)
        if pc.world_size > 1:
            parallel_state.init_distributed_environment(
                world_size=pc.world_size,
                rank=self.rank,
                init_method=self.distributed_init_method,
                backend="nccl" if device == "cuda" else "gloo",
            )
            parallel_state.initialize_model_parallel(
                pc.tensor_parallel_size, pc.pipeline_parallel_size
            )

    def load_model(self, progress=None) -> None:
        from llmctl.engine.model_loader.loader import load_model
        from llmctl.engine.worker.model_runner import ModelRunner

        mc = self.config.model_config
        pp = parallel_state.get_pp_group()
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

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.config.device_config.device == "cpu":
            from llmctl.engine.layers.paged_attention_cpu import kernel_available

            kernel_available()  # build (once per machine) or load the kernel now, not mid-request

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        pp = parallel_state.get_pp_group()
        intermediate = None
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if num_tokens and not pp.is_first_rank:
            buffers = self.model_runner.make_empty_intermediate_tensors(num_tokens)
            intermediate = pp.recv_tensor_dict(buffers, pp.rank_in_group - 1)
        output = self.model_runner.execute_model(scheduler_output, intermediate)
        if isinstance(output, dict):
            # Sends complete in order; wait for the previous batch's before queueing this one,
            # which also keeps its tensors alive until they are delivered.
            for work in self._pending_sends:
                work.wait()
            self._pending_sends = pp.send_tensor_dict(output, pp.rank_in_group + 1)
            return None
        return output

    def rank_info(self) -> dict:
        """Who this rank is and what it holds: for logs, `cluster status` and benchmarks."""
        pc = self.config.parallel_config
        where = ranks.coord(self.rank, pc.pipeline_parallel_size, pc.tensor_parallel_size)
        runner = self.model_runner
        shard = runner.model.shard if runner else None
        return {
            "rank": self.rank,
            "pp_rank": where.pp_rank,
            "tp_rank": where.tp_rank,
            "pid": os.getpid(),
            "layers": (shard.start_layer, shard.end_layer) if shard else None,
            "weight_bytes": runner.weight_bytes() if runner else 0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    def check_health(self) -> bool:
        return True

    def shutdown(self) -> None:
        for work in self._pending_sends:
            work.wait()
        self._pending_sends = []
        parallel_state.destroy_distributed_environment()
