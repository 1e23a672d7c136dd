"""make_plan: choose the TP x PP layout for a model on an inventory, and predict its KV cache.

Pure: a ModelSpec and an Inventory in, a Plan out (no SSH, no torch, no mutation). The concerns
live apart: plan_options.py (what to plan for), memory_model.py (bytes per rank and KV blocks of
a layout), layout_rules.py (rules 1-4 below), quantized_fallback.py (rule 5), replicas.py (data
parallel), plan.py (the Plan value and its rendering); this module joins them.

Memory per GPU is sized by the engine's own arithmetic (engine/config/memory_profile.py), on
estimates of what the engine measures: the weights each rank really holds (ModelShape counts the
engine's shards: its layers, the embedding on the first stage, the final norm and LM head on the
last; in bytes of each weight's storage, cluster/plan/weight_format.py: the dtype, a GGUF
file's blocks, or --quantization's groups), the
peak activations of the profile step at max_num_batched_tokens, and the memory outside torch (the
CUDA context, NCCL); the rest of gpu_memory_utilization x memory is KV cache. The KV cache has as
many blocks as the rank with the fewest can hold, as the engine does. On the CPU the KV cache is
kv_cache_space_gib exactly, as the engine allocates it, so the block count is the engine's own
(`cpu_num_gpu_blocks` over `ModelShape.kv_cache_bytes_per_block`).

The rules, from vLLM's distributed-serving guide, then better:
  1. The model fits one GPU with room for min_concurrency requests of max_model_len: tp=1.
  2. Else it fits one node: the smallest tensor-parallel size that fits (a size that divides the
     heads, unless uneven TP is allowed); the node's full width is offered for throughput.
     Without NVLink (PCIe), pipeline stages inside the node instead: activations cross the link
     once per stage, not twice per layer.
  3. If only a tp that does not divide the heads would fit: tp=1, pp = that many GPUs. The
     uneven tp (whole KV-head groups per rank, which our engine runs and vLLM cannot) is offered
     next to it as "llmctl only", and chosen with --allow-uneven-tp.
  4. Else across nodes: tp = GPUs per node, pp = the fewest nodes that fit.
  5. A float checkpoint that no layout holds: the same rules on its weight-only quantization,
     int8, else int4, printed with its --quantization flag. A quantized layout splits every
     row-parallel layer's inputs on whole quantization groups, as the engine requires.
Pipeline stages get an uneven layer split when it holds more KV cache (the first and last stages
carry the embedding and LM head), printed as --pipeline-layer-partition.
Data parallel (`--data-parallel-size N`, engine/dp/dp_async_llm.py): a layout that fits one node in
fewer GPUs than the node has (and was not asked with -tp/-pp) is proposed as replicas, as many
as the node holds (each its own engine and KV cache: N replicas serve about N times the
requests); the plan prints the KV tokens and concurrency per replica and in total. An asked N
plans one replica on the node's GPUs / N. With several GPU nodes and a layout that fits one, the
replicas span the nodes (vLLM's multi-node data parallel: the head serves the API with its
--data-parallel-size-local replicas, every other node runs its own with --headless), one serve
command per node.
"""

from __future__ import annotations

from llmctl.cluster.inventory import Inventory
from llmctl.cluster.plan.model_spec import ModelSpec
from llmctl.cluster.plan.plan import Plan
from llmctl.cluster.plan.plan_options import PlanOptions
from llmctl.cluster.plan.quantized_fallback import replica_plan
from llmctl.cluster.plan.replicas import (
    across_nodes,
    asked_replicas,
    gpu_nodes,
    shared_experts_error,
    with_replicas,
)


def make_plan(spec: ModelSpec, inventory: Inventory, options: PlanOptions | None = None) -> Plan:
    """The layout for `spec` on `inventory`, with its data-parallel replicas: those asked (one
    replica planned on the node's GPUs / N), or as many as one node holds. See replica_plan."""
    options = options or PlanOptions()
    dp = options.data_parallel_size
    if dp is not None and dp > 1:
        return asked_replicas(spec, inventory, options, dp)
    plan = replica_plan(spec, inventory, options)
    asked = options.tensor_parallel_size or options.pipeline_parallel_size
    if dp is not None or asked or plan.device == "cpu" or plan.nodes_used > 1:
        return plan  # an asked layout is evaluated as asked: replicas only with -dp
    gpus_per_node = min(n.gpus for n in inventory.nodes if n.gpus)
    per_node = gpus_per_node // plan.gpus_used
    nodes = gpu_nodes(inventory)
    replicas = per_node * len(nodes)
    if replicas < 2 or shared_experts_error(plan, replicas, len(nodes) > 1) is not None:
        return plan  # (replicas sharing their experts only where they can)
    where = f"{plan.gpus_used} GPUs" if plan.gpus_used > 1 else "one GPU"
    if len(nodes) == 1:
        reason = (
            f"fits {where} of a node of {gpus_per_node}: {replicas} data-parallel replicas "
            f"(--data-parallel-size {replicas}), each its own engine and KV cache, serve about "
            f"{replicas}x the requests of one"
        )
        return with_replicas(plan, replicas, reason)
    reason = (
        f"fits {where} of a node of {gpus_per_node}: {replicas} data-parallel replicas, "
        f"{per_node} on each of {len(nodes)} nodes (--data-parallel-size {replicas} "
        f"--data-parallel-size-local {per_node}), each its own engine and KV cache, serve about "
        f"{replicas}x the requests of one; node 0 serves the API, the others join it headless"
    )
    return across_nodes(plan, nodes, per_node, reason)
