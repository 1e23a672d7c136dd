"""The layout rules (planner.py's 1-4): one GPU, tensor parallel in a node, pipeline stages
across nodes, uneven TP offered where the heads do not divide; and the Plan of the chosen
layout (`finish`), or the PlanError that says why nothing fits."""

from __future__ import annotations

import math

from llmctl.cluster.errors import PlanError
from llmctl.cluster.inventory import Inventory
from llmctl.cluster.plan.memory_model import (
    Evaluation,
    PlanContext,
    activation_bytes,
    evaluate,
    gpu_bytes,
    resolve_context,
)
from llmctl.cluster.plan.model_spec import ModelSpec
from llmctl.cluster.plan.plan import Plan, RunStep, gib
from llmctl.cluster.plan.plan_options import PlanOptions
from llmctl.engine.config.engine_args import engine_args_to_argv
from llmctl.engine.config.memory_profile import (
    estimate_non_torch_bytes,
)
from llmctl.engine.distributed.partition import valid_tp_sizes
from llmctl.engine.errors import ConfigError


def layout_label(tp: int, pp: int) -> str:
    return f"tp={tp}, pp={pp}"


def _even_tp(spec: ModelSpec, tp: int) -> bool:
    """vLLM's condition: tp divides the heads, and divides or is a multiple of the KV heads."""
    kv = spec.num_kv_heads
    return spec.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def _uneven_tp(spec: ModelSpec, tp: int) -> bool:
    """A tp our engine runs (whole KV-head groups per rank, as evenly as possible) but vLLM,
    which needs tp to divide the heads, does not."""
    return not _even_tp(spec, tp) and tp in valid_tp_sizes(spec.num_heads, spec.num_kv_heads)


def llmctl_only(tp: int, pp: int = 1) -> str:
    return f"{layout_label(tp, pp)} (llmctl only)"


def _uneven_split(spec: ModelSpec, tp: int) -> str:
    """How the uneven ranks share the heads: "KV heads 3,3,2 (query heads 12,12,8) per rank"."""
    shards = spec.shape.tensor_parallel_heads(tp)
    kv = ",".join(str(s.num_kv_heads) for s in shards)
    q = ",".join(str(s.num_q_heads) for s in shards)
    return (
        f"uneven tensor parallel: KV heads {kv} (query heads {q}) per rank, whole KV-head groups "
        f"on each; vLLM cannot run it, since tp={tp} does not divide {spec.num_heads} heads "
        f"({spec.num_kv_heads} KV)"
    )


def _uneven_offer(
    ctx: PlanContext, spec: ModelSpec, tp: int, evaluation: Evaluation, flag: bool
) -> tuple:
    held = evaluation.blocks * ctx.options.block_size
    offer = f"{_uneven_split(spec, tp)}; holds {held:,} KV tokens"
    if flag:
        offer += "; --allow-uneven-tp lets the planner choose it"
    return llmctl_only(tp), offer


def choose_layout(spec: ModelSpec, inventory: Inventory, options: PlanOptions) -> Plan:
    ctx = resolve_context(spec, inventory, options)
    rejected: list[tuple[str, str]] = []
    alternatives: list[tuple[str, str]] = []
    if options.device == "cpu" or options.tensor_parallel_size or options.pipeline_parallel_size:
        tp, pp = options.tensor_parallel_size or 1, options.pipeline_parallel_size or 1
        valid = valid_tp_sizes(spec.num_heads, spec.num_kv_heads)
        if tp not in valid:
            raise ConfigError(
                f"tensor_parallel_size={tp} cannot split {spec.num_heads} attention heads "
                f"({spec.num_kv_heads} KV heads)",
                f"use one of {', '.join(map(str, valid))}",
            )
        ctx.weights.check_split(spec.shape, tp, valid)
        spec.shape.check_tensor_parallel(tp, options.enable_expert_parallel)
        chosen = evaluate(ctx, tp, pp, options.pipeline_layer_partition)
        reasons = [f"{layout_label(tp, pp)} as asked"]
        if _uneven_tp(spec, tp):
            reasons.append(f"llmctl only: {_uneven_split(spec, tp)}")
        if not chosen.fits(ctx):
            raise _too_big(ctx, [chosen], f"the asked layout {layout_label(tp, pp)}")
        return _finish(ctx, chosen, reasons, rejected, alternatives)

    need = ctx.max_model_len * options.min_concurrency
    want = f"room for {options.min_concurrency} request(s) of {ctx.max_model_len:,} tokens"
    gpus, nodes = ctx.gpus_per_node, ctx.nodes
    pcie = any(n.interconnect == "pcie" for n in inventory.nodes if n.gpus)
    tried: list[Evaluation] = []

    def attempt(tp: int, pp: int) -> Evaluation | None:
        if pp > spec.num_layers:
            rejected.append(
                (layout_label(tp, pp), f"more stages than the {spec.num_layers} layers")
            )
            return None
        evaluation = evaluate(ctx, tp, pp)
        tried.append(evaluation)
        if evaluation.fits(ctx):
            return evaluation
        held = evaluation.blocks * options.block_size
        rejected.append((layout_label(tp, pp), f"holds {held:,} KV tokens, needs {need:,}"))
        return None

    def whole(tp: int) -> bool:
        """Quantized weights: every rank's row-parallel inputs are whole quantization groups."""
        return not ctx.weights.cut_groups(spec.shape, tp, options.enable_expert_parallel)

    def allowed(tp: int) -> bool:
        if options.enable_expert_parallel and tp > spec.num_experts:
            return False  # some rank would hold no expert
        return whole(tp) and (
            _even_tp(spec, tp)
            or (options.allow_uneven_tp and tp in valid_tp_sizes(spec.num_heads, spec.num_kv_heads))
        )

    def uneven_whole(tp: int) -> bool:
        return whole(tp) and _uneven_tp(spec, tp)

    # 1. One GPU.
    chosen = attempt(1, 1)
    if chosen is not None:
        reasons = [f"the model fits one GPU with {want}: no distributed inference needed"]
        if gpus > 1 and allowed(gpus):
            alternatives.append(_full_width(ctx, chosen, gpus))
        elif gpus > 1 and uneven_whole(gpus):
            layout, offer = _full_width(ctx, chosen, gpus)
            alternatives.append((llmctl_only(gpus), f"{offer}; {_uneven_split(spec, gpus)}"))
        return _finish(ctx, chosen, reasons, rejected, alternatives)

    # 2. One node.
    if gpus > 1:
        if pcie:
            for k in range(2, gpus + 1):
                chosen = attempt(1, k)
                if chosen is not None:
                    reasons = [
                        f"too big for one GPU; fits {k} GPUs of one node with {want}",
                        "no NVLink (PCIe): pipeline stages inside the node, whose activations "
                        "cross the link once per stage instead of twice per layer",
                    ]
                    return _finish(ctx, chosen, reasons, rejected, alternatives)
        else:
            for tp in range(2, gpus + 1):
                cuts = ctx.weights.cut_groups(spec.shape, tp, options.enable_expert_parallel)
                if cuts:
                    rejected.append(
                        (layout_label(tp, 1), f"cuts the quantization groups of {cuts[0]}")
                    )
                    continue
                if not allowed(tp):
                    if _uneven_tp(spec, tp):
                        uneven = evaluate(ctx, tp, 1)
                        if uneven.fits(ctx):
                            # What our engine can do and vLLM cannot, offered next to the
                            # vLLM-compatible layout chosen below.
                            alternatives.append(_uneven_offer(ctx, spec, tp, uneven, True))
                            chosen = attempt(1, tp)
                            if chosen is not None:
                                reasons = [
                                    f"too big for one GPU; {tp} GPUs hold it, but tp={tp} does "
                                    f"not divide {spec.num_heads} heads ({spec.num_kv_heads} KV)",
                                    f"so pipeline parallel over {tp} GPUs (tp=1, pp={tp}), which "
                                    "splits layers unevenly (--allow-uneven-tp would use tp)",
                                ]
                                return _finish(ctx, chosen, reasons, rejected, alternatives)
                            continue
                        held = uneven.blocks * options.block_size
                        why = f"uneven tensor parallel holds {held:,} KV tokens, needs {need:,}"
                        rejected.append((llmctl_only(tp), why))
                        continue
                    rejected.append(
                        (layout_label(tp, 1), f"tp={tp} does not divide {spec.num_heads} heads")
                    )
                    continue
                chosen = attempt(tp, 1)
                if chosen is not None:
                    reasons = [
                        f"too big for one GPU; fits one node with tensor parallel over {tp} "
                        f"GPUs with {want}",
                        f"tp={tp} is the smallest tensor-parallel size that fits",
                    ]
                    if _uneven_tp(spec, tp):
                        reasons.append(f"llmctl only: {_uneven_split(spec, tp)}")
                    if tp < gpus and allowed(gpus):
                        alternatives.append(_full_width(ctx, chosen, gpus))
                    elif tp < gpus and uneven_whole(gpus):
                        layout, offer = _full_width(ctx, chosen, gpus)
                        offer = f"{offer}; {_uneven_split(spec, gpus)}"
                        alternatives.append((llmctl_only(gpus), offer))
                    return _finish(ctx, chosen, reasons, rejected, alternatives)

    # 3. Across nodes: tp = GPUs per node, pp = nodes used.
    tp = max((t for t in range(1, gpus + 1) if allowed(t)), default=1)
    for n in range(2, nodes + 1):
        chosen = attempt(tp, n)
        if chosen is not None:
            reasons = [
                f"too big for one node; fits {n} nodes with {want}",
                f"tensor parallel inside each node (tp={tp}"
                + ("" if tp == gpus else f", the largest size <= {gpus} that divides the heads")
                + f"), pipeline parallel across the {n} nodes (pp={n})",
            ]
            if tp < gpus and uneven_whole(gpus):
                wider = evaluate(ctx, gpus, n)
                if wider.fits(ctx):
                    ratio = wider.blocks / max(chosen.blocks, 1)
                    offer = f"every GPU of the {n} nodes: {ratio:.1f}x the KV cache"
                    alternatives.append(
                        (llmctl_only(gpus, n), f"{offer}; {_uneven_split(spec, gpus)}")
                    )
            return _finish(ctx, chosen, reasons, rejected, alternatives)
    raise _too_big(ctx, tried, f"{nodes} node(s) x {gpus} GPU(s) of {ctx.gpu_gib:g} GiB")


def _full_width(ctx: PlanContext, chosen: Evaluation, gpus: int) -> tuple[str, str]:
    """The throughput option: tensor parallel over the whole node."""
    ratio = evaluate(ctx, gpus, 1).blocks / max(chosen.blocks, 1)
    return layout_label(
        gpus, 1
    ), f"the node's full width: {ratio:.1f}x the KV cache, for throughput"


def _finish(ctx: PlanContext, chosen: Evaluation, reasons, rejected, alternatives) -> Plan:
    spec, opts = ctx.spec, ctx.options
    tp, pp = chosen.tp, chosen.pp
    world = tp * pp
    if opts.device == "cpu":
        nodes_used = 1
    else:
        nodes_used = math.ceil(world / ctx.gpus_per_node) if world > ctx.gpus_per_node else 1
    backend = "uni" if world == 1 else ("ray" if nodes_used > 1 else "mp")
    reasons = list(reasons)
    if not chosen.default_parts:
        reasons.append(
            f"uneven layer split {','.join(map(str, chosen.parts))}: the first and last stages "
            "also hold the embedding and the LM head, so they take fewer layers and every stage "
            "keeps about the same room for KV cache"
        )
    blocks = chosen.blocks
    worst = min(chosen.ranks, key=lambda r: r.num_blocks)
    reasons.append(
        f"the KV cache has {blocks:,} blocks: as many as rank {worst.rank} (the fewest) holds"
    )
    # `llmctl serve`: the layout, then the options the prediction depends on where they differ
    # from the engine's defaults, spelled as EngineArgs declares them.
    defaults = PlanOptions()
    cpu = opts.device == "cpu"
    layout = {
        "tensor_parallel_size": tp if tp > 1 else None,
        "pipeline_parallel_size": pp if pp > 1 else None,
        "distributed_executor_backend": backend if world > 1 else None,
        "pipeline_layer_partition": None if chosen.default_parts else chosen.parts,
    }
    engine = {
        "dtype": ctx.dtype if opts.dtype != "auto" else None,
        "max_model_len": (
            ctx.max_model_len if ctx.max_model_len != spec.max_position_embeddings else None
        ),
        "device": "cpu" if cpu else None,
        "kv_cache_space_gib": opts.kv_cache_space_gib if cpu else None,
        "gpu_memory_utilization": (
            opts.gpu_memory_utilization
            if not cpu and opts.gpu_memory_utilization != defaults.gpu_memory_utilization
            else None
        ),
        "block_size": opts.block_size if opts.block_size != defaults.block_size else None,
        "max_num_seqs": opts.max_num_seqs if opts.max_num_seqs != defaults.max_num_seqs else None,
        "max_num_batched_tokens": opts.max_num_batched_tokens,
        "quantization": opts.quantization,
        "enable_expert_parallel": opts.enable_expert_parallel or None,
    }
    serve = ["llmctl", "serve", spec.name, *engine_args_to_argv(layout, aliases=True)]
    serve += engine_args_to_argv(engine)
    steps = [RunStep("serve", tuple(serve))]
    if nodes_used > 1:  # start the cluster, then serve on it
        source = ctx.inventory.source if ctx.inventory.source != "<flags>" else "cluster.yaml"
        steps = [
            RunStep("cluster_up", ("llmctl", "cluster", "up", "-i", source)),
            RunStep("serve", (*serve[:2], "-i", source, *serve[2:])),
        ]
    return Plan(
        device=opts.device,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        gpu_memory_bytes=gpu_bytes(ctx),
        profile_num_tokens=ctx.num_tokens,
        profile_num_sampled=ctx.num_sampled,
        model=spec.name,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        nodes_used=nodes_used,
        gpus_used=world,
        layer_partition=chosen.parts,
        default_partition=chosen.default_parts,
        distributed_executor_backend=backend,
        dtype=ctx.dtype,
        block_size=opts.block_size,
        max_model_len=ctx.max_model_len,
        num_kv_blocks=blocks,
        ranks=chosen.ranks,
        reasons=tuple(reasons),
        rejected=tuple(rejected),
        alternatives=tuple(alternatives),
        steps=tuple(steps),
        serve_args={**layout, **engine},
        quantization=opts.quantization,
        weight_format=ctx.weights.label(),
        weight_format_detail=ctx.weights.detail(spec.shape) if ctx.weights.quantized else "",
        num_experts=spec.shape.num_experts or 0,
    )


def _too_big(ctx: PlanContext, tried: list[Evaluation], what: str) -> PlanError:
    """How much memory is missing, and what would fit instead."""
    spec, opts = ctx.spec, ctx.options
    need_tokens = ctx.max_model_len * opts.min_concurrency
    weights = ctx.weights.rank_bytes(
        spec.shape, (0, spec.num_layers), 0, 1, is_first=True, is_last=True
    )
    kv = need_tokens * spec.shape.kv_bytes_per_token(spec.num_layers, 0, 1, ctx.kv_bytes)
    if opts.device == "cpu":
        best = max(tried, key=lambda e: e.blocks) if tried else None
        held = best.blocks * opts.block_size if best else 0
        return PlanError(
            f"the KV cache of {opts.kv_cache_space_gib} GiB per rank holds {held:,} tokens; "
            f"{need_tokens:,} are needed ({opts.min_concurrency} x {ctx.max_model_len:,})",
            "raise --kv-cache-space-gib, or lower --max-model-len or --min-concurrency",
        )
    gpus_total = ctx.gpus_per_node * ctx.nodes
    usable = gpu_bytes(ctx) * opts.gpu_memory_utilization
    per_gpu_overhead = activation_bytes(ctx, 0, 1, True) + estimate_non_torch_bytes(gpus_total)
    needed = weights + kv + per_gpu_overhead * gpus_total
    available = usable * gpus_total
    missing = max(needed - available, 0)
    hints = []
    room = usable - per_gpu_overhead
    if room > 0:
        hints.append(f"about {math.ceil((weights + kv) / room)} GPUs of {ctx.gpu_gib:g} GiB")
    shorter = _longest_fitting_len(ctx, tried)
    if shorter:
        hints.append(f"--max-model-len {shorter}")
    message = (
        f"{spec.name} does not fit {what} with room for {opts.min_concurrency} request(s) of "
        f"{ctx.max_model_len:,} tokens: weights {gib(weights)} ({ctx.weights.label()}) + "
        f"KV cache {gib(kv)} + activations and memory outside torch "
        f"{gib(per_gpu_overhead)} per GPU"
    )
    if missing:
        message += f"; {gib(missing)} more memory is needed"
    return PlanError(message, "what would fit: " + ("; ".join(hints) or "a larger inventory"))


def _longest_fitting_len(ctx: PlanContext, tried: list[Evaluation]) -> int | None:
    best = max((e.blocks for e in tried), default=0)
    tokens = best * ctx.options.block_size // ctx.options.min_concurrency
    return tokens if 0 < tokens < ctx.max_model_len else None
