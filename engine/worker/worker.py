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

from llmctl.engine import platform
from llmctl.engine.config.engine_config import EngineConfig
from llmctl.engine.config.memory_profile import (
    GIB,
    MemoryProfile,
    cpu_num_gpu_blocks,
    num_gpu_blocks,
)
from llmctl.engine.core.model_runner_output import ModelRunnerOutput
from llmctl.engine.core.scheduler_output import SchedulerOutput
from llmctl.engine.distributed import parallel_state, ranks
from llmctl.engine.distributed.partition import pipeline_shard
from llmctl.engine.errors import DeviceMemoryError

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
        pc = self.config.parallel_config
        device = self.config.device_config.device
        if device == "cpu":
            if self.rank == 0:
                platform.log_cpu_path()
        else:
            torch.cuda.set_device(self.local_rank)
        if pc.world_size_across_dp > 1:  # data-parallel replicas may share one world
            parallel_state.init_distributed_environment(
                world_size=pc.world_size_across_dp,
                rank=pc.global_rank_offset + self.rank,
                init_method=self.distributed_init_method,
                backend="nccl" if device == "cuda" else "gloo",
            )
            parallel_state.initialize_model_parallel(
                pc.tensor_parallel_size,
                pc.pipeline_parallel_size,
                pc.enable_expert_parallel,
                pc.world_size_across_dp // pc.world_size,
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
        device = self.config.device_config.device
        if device == "cpu":
            model = load_model(mc, shard, device, progress)
            platform.release_free_heap()
            # Tuned after loading: glibc's own thresholds hand the load's temporaries (blocks
            # decoded while packing) back as they go, where the tuned heap kept them all until
            # the trim above (17 MB above the steady state at the peak, the bundled model).
            platform.tune_cpu_allocator()
        else:
            free_before = torch.cuda.mem_get_info()[0]
            try:
                model = load_model(mc, shard, device, progress)
            except torch.cuda.OutOfMemoryError:
                model = None  # raised below, outside this block: no frame keeps the partial model
            if model is None:
                torch.cuda.empty_cache()
                raise self._weights_do_not_fit(shard, free_before)
        self.model_runner = ModelRunner(self.config, model)

    def determine_num_available_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if self.config.device_config.device == "cpu":
            return cpu_num_gpu_blocks(cache.kv_cache_space_gib, per_block)
        profile = self.profile_memory()
        utilization = cache.gpu_memory_utilization
        logger.info("Memory profiling (rank %d): %s", self.rank, profile.describe(utilization))
        return num_gpu_blocks(profile, utilization, per_block)

    def profile_memory(self) -> MemoryProfile:
        """Run the profile step (a forward and sampling at max_num_batched_tokens) and measure
        this GPU, as vLLM does before it sizes the KV cache (engine/config/memory_profile.py)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        try:
            self.model_runner.profile_run()
        except torch.cuda.OutOfMemoryError:
            failed = True  # raised below, outside this block: the activations are freed
        else:
            failed = False
        torch.cuda.synchronize()
        if failed:
            torch.cuda.empty_cache()
            raise self._profile_does_not_fit(weights)
        free, total = torch.cuda.mem_get_info()
        return MemoryProfile(
            total_bytes=total,
            weight_bytes=weights,
            peak_torch_bytes=torch.cuda.max_memory_allocated(),
            non_torch_bytes=(total - free) - torch.cuda.memory_reserved(),
        )

    def _weights_do_not_fit(self, shard, free_before: int) -> DeviceMemoryError:
        mc, pc = self.config.model_config, self.config.parallel_config
        total = torch.cuda.mem_get_info()[1]
        where = ranks.coord(self.rank, pc.pipeline_parallel_size, pc.tensor_parallel_size)
        smaller_dtype = "; --dtype bfloat16 halves float32 weights" if mc.dtype == "float32" else ""
        return DeviceMemoryError(
            f"the weights of rank {self.rank} (layers {shard.start_layer}-{shard.end_layer - 1}, "
            f"tensor-parallel rank {where.tp_rank} of {pc.tensor_parallel_size}, {mc.dtype}) do "
            f"not fit on GPU {self.local_rank}: it ran out of memory loading them "
            f"({free_before / GIB:.2f} of {total / GIB:.2f} GiB were free)",
            "split the weights over more GPUs: -tp N within a node, -pp N for pipeline stages "
            "(several nodes: --distributed-executor-backend ray); `llmctl plan MODEL` shows a "
            f"layout that fits{smaller_dtype}. A lower --max-model-len does not shrink weights; "
            "quantized weights would, but llmctl loads weights unquantized (GGUF files are "
            "dequantized)",
        )

    def _profile_does_not_fit(self, weight_bytes: int) -> DeviceMemoryError:
        sc = self.config.scheduler_config
        total = torch.cuda.mem_get_info()[1]
        return DeviceMemoryError(
            f"GPU {self.local_rank} ran out of memory in the profile step of "
            f"{sc.max_num_batched_tokens} tokens ({sc.max_num_seqs} requests at most), with "
            f"{weight_bytes / GIB:.2f} of {total / GIB:.2f} GiB taken by the weights",
            "lower --max-num-batched-tokens or --max-num-seqs, or split the model over more "
            "GPUs with -tp/-pp",
        )

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.config.device_config.device == "cpu":
            from llmctl.engine.kernels.cpu.paged_attention_cpu import kernel_available

            kernel_available()  # build (once per machine) or load the kernel now, not mid-request
        else:
            # After the KV cache, as vLLM: the graphs' memory comes out of what
            # gpu_memory_utilization leaves free. Nothing is captured with --enforce-eager.
            self.model_runner.capture_cuda_graphs()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        pp = parallel_state.get_pp_group()
        intermediate = None
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if num_tokens and not pp.is_first_rank:
            buffers = self.model_runner.make_empty_intermediate_tensors(num_tokens)
            intermediate = pp.recv_tensor_dict(buffers, pp.rank_in_group - 1)
        output = self.model_runner.execute_model(scheduler_output, intermediate)
        if output.intermediate_tensors is not None:
            # Sends complete in order; wait for the previous batch's before queueing this one,
            # which also keeps its tensors alive until they are delivered.
            for work in self._pending_sends:
                work.wait()
            self._pending_sends = pp.send_tensor_dict(
                output.intermediate_tensors, pp.rank_in_group + 1
            )
            return ModelRunnerOutput()
        return output

    def execute_dummy_batch(self) -> None:
        """A forward of one token of no request (engine/dp/lockstep.py)."""
        self.model_runner.execute_dummy_batch()

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

    def release_free_heap(self) -> None:
        """The engine went idle: on the CPU, give the heap's free pages back to the kernel. The
        allocator keeps freed activations for the next step (platform.tune_cpu_allocator), so
        without this a server's resident set stays at its longest prefill's activations."""
        if self.config.device_config.device == "cpu":
            platform.release_free_heap()

    def shutdown(self) -> None:
        for work in self._pending_sends:
            work.wait()
        self._pending_sends = []
        parallel_state.destroy_distributed_environment()
