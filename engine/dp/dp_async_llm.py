"""DPAsyncLLM: data-parallel replicas of the engine behind AsyncLLM's interface.

    DPAsyncLLM.generate  ->  DPRouter.route (engine/dp/router.py)  ->  replica r's AsyncLLM

Each replica is a whole engine (`--data-parallel-size N`): its own engine thread, scheduler, KV
cache and executor with tp x pp worker processes (`mp`: their own rendezvous port, and on the CPU
cores / (N x tp x pp) torch threads each, so replicas do not fight over cores). Replicas are built
at the same time and share nothing but this process. Across nodes (--data-parallel-size-local),
the others run on --headless nodes and join here (engine/dp/join_server.py); each is a
RemoteReplica (engine/dp/remote_replica.py) with the same interface, routed as a local one.

A replica whose worker dies fails its own requests in flight (EngineDeadError, as a single engine
does) and is routed nothing more; the others serve on. A request that reached a replica already
dead, before it took the request, is routed again: nothing of it ran. `health_error()` is set
only once every replica stopped; `replica_states()` tells /health and /metrics which one and why.
With --restart-on-failure a replica that failed builds a new engine in its thread: once that one
serves (the replica's health clears and its engine is not the one that failed), the replica
rejoins routing, with an empty prefix cache. A remote replica whose node was lost rejoins the
same way when a node started again with its --data-parallel-start-rank has built its engine
(DPJoinServer.take_rejoined): the new RemoteReplica takes the lost one's place.

With --enable-expert-parallel on a mixture-of-experts model, the replicas are DP attention + EP
MoE layers (engine/dp/lockstep.py): their workers share one torch.distributed world (one
rendezvous port, chosen here), the experts are dealt over all DP x TP ranks, and the replicas'
engine threads step together. One replica's failure then stops all of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from llmctl.engine.client.async_llm import AsyncLLM
from llmctl.engine.client.protocol import Supervision
from llmctl.engine.config.engine_config import EngineConfig
from llmctl.engine.core.llm_engine import EngineStats, LLMEngine, PromptType
from llmctl.engine.dp.router import DPRouter
from llmctl.engine.errors import EngineDeadError, EngineRestartingError
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.sampling_params import SamplingParams

logger = logging.getLogger("llmctl")


def replica_configs(config: EngineConfig, local: int | None = None) -> list[EngineConfig]:
    """One EngineConfig per data-parallel replica on this node (`local` of them; default all),
    told its index here: data_parallel_rank and data_parallel_size are this node's, which place
    a replica's devices and share out the cores (across nodes, DPPlacement keeps the global
    ranks)."""
    pc = config.parallel_config
    local = pc.data_parallel_size if local is None else local
    shared = {}
    if pc.expert_parallel_across_dp:  # one world for every replica's workers
        from llmctl.engine.distributed.ports import free_port

        shared = {"data_parallel_master_port": pc.data_parallel_master_port or free_port()}
    return [
        dataclasses.replace(
            config,
            parallel_config=dataclasses.replace(
                pc, data_parallel_size=local, data_parallel_rank=index, **shared
            ),
        )
        for index in range(local)
    ]


def start_replicas(
    configs: list[EngineConfig], engine_args, progress=None, lockstep=None
) -> list[AsyncLLM]:
    """Build every replica at once, each in its own engine thread; if one fails, the others
    are stopped and its error raised. With a `lockstep` (DP attention + EP MoE) the first
    failure aborts the others' start at once: their workers would wait for its in their
    shared rendezvous."""

    def builder(index: int):
        # only the first replica reports loading progress (one bar, not N interleaved)
        return lambda: LLMEngine(configs[index], progress if index == 0 else None)

    def rebuilder(index: int):
        return lambda: LLMEngine(configs[index])

    started = [
        AsyncLLM.start_building(
            builder(index),
            thread_name=f"llmctl-engine-dp{index}",
            rebuild=rebuilder(index),
            stall_timeout=engine_args.stall_timeout,
            restart_on_failure=engine_args.restart_on_failure,
            max_restarts=engine_args.max_restarts,
            lockstep=lockstep,
            replica_index=index,
        )
        for index in range(len(configs))
    ]
    futures = [built for _, built in started]
    first = None
    if lockstep is not None:
        done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        first = next((f.exception() for f in done if f.exception() is not None), None)
        if first is not None:
            reason = getattr(first, "message", None) or f"{type(first).__name__}: {first}"
            lockstep.fail(EngineDeadError(f"it failed to start: {reason}"))
    concurrent.futures.wait(futures)
    errors = [built.exception() for _, built in started if built.exception() is not None]
    if errors:
        for replica, built in started:
            if built.exception() is None:
                replica.shutdown()
        raise first or errors[0]
    return [replica for replica, _ in started]


class DPAsyncLLM:
    def __init__(self, replicas: list) -> None:
        """`replicas`: AsyncLLMs, or RemoteReplicas (engine/dp/remote_replica.py) of other
        nodes, in data-parallel rank order; the router treats both alike."""
        self.replicas = replicas
        self.engine = replicas[0].engine  # config and tokenizer (the same in every replica)
        config = self.engine.config
        self.max_model_len = config.model_config.max_model_len
        self.router = DPRouter(len(replicas), config.cache_config.block_size)
        self.join_server = None  # the head's listener for replicas of other nodes
        self.lockstep = None  # DPLockstep: the replicas step together (DP attention + EP MoE)
        # replica -> the engine it ran when it was marked dead: it rejoins on another one
        self._failed_engines: dict[int, LLMEngine | None] = {}

    @classmethod
    def from_engine_args(cls, engine_args, progress=None) -> DPAsyncLLM:
        """Build this node's replicas; with replicas on other nodes (--data-parallel-size-local),
        wait for them to join (engine/dp/join_server.py). Raises what building one raised."""
        placement = engine_args.data_parallel_placement()
        config = engine_args.create_engine_config(progress)
        join_server = None
        if placement.remote_ranks:
            from llmctl.engine.dp.join_server import DPJoinServer

            join_server = DPJoinServer(
                placement, config, engine_args.rendezvous_timeout, engine_args.stall_timeout
            )
        configs = replica_configs(config, placement.local)
        lockstep = None
        if config.parallel_config.expert_parallel_across_dp:
            from llmctl.engine.dp.lockstep import DPLockstep

            pc = configs[0].parallel_config
            lockstep = DPLockstep(pc.data_parallel_size, pc.data_parallel_master_port)
        try:
            replicas = start_replicas(configs, engine_args, progress, lockstep)
        except BaseException:
            if join_server is not None:
                join_server.close(reason="the head failed to start its own replicas")
            if lockstep is not None:
                lockstep.close()
            raise
        if join_server is not None:
            try:
                replicas += join_server.wait_for_replicas()
            except BaseException:
                for replica in replicas:
                    replica.shutdown()
                raise
        logger.info("Started %d data-parallel replicas", len(replicas))
        dp = cls(replicas)
        dp.join_server = join_server
        dp.lockstep = lockstep
        return dp

    # -- EngineClient (client/protocol.py) -------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.health_error() is None

    def health_error(self) -> EngineDeadError | None:
        """None while one replica can serve; else why none can, replica by replica."""
        self._note_deaths()
        return None if self.router.live else self._none_live_error()

    def replica_states(self) -> list[tuple[int, EngineStats, EngineDeadError | None]]:
        self._note_deaths()
        dead = self.router.dead  # also what a request learnt before the replica's thread did
        states = []
        for i, replica in enumerate(self.replicas):
            error = None
            if i in dead:  # the replica's own word first: restarting, or dead and why
                error = replica.health_error() or EngineDeadError(dead[i])
            states.append((i, replica.get_stats(), error))
        return states

    def supervision(self) -> list[Supervision]:
        return [replica.supervision()[0] for replica in self.replicas]

    def health(self) -> dict:
        """/health's body while every replica serves."""
        return {"status": "ok", "replicas": [replica.health() for replica in self.replicas]}

    def get_stats(self) -> EngineStats:
        """The replicas' counters summed (KV-cache usage: their mean)."""
        stats = [replica.get_stats() for replica in self.replicas]
        total = EngineStats(
            *(sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats))
        )
        total.kv_cache_usage /= len(stats)
        return total

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, on_accepted=None
    ) -> AsyncIterator[RequestOutput]:
        """Route the request, then yield its outputs from the replica that took it."""
        prompt, prompt_ids = self._with_token_ids(prompt)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(0, self.max_model_len - len(prompt_ids))
        while True:
            self._note_deaths()
            if not self.router.live:
                raise self._none_live_error()
            replica = self.router.route(request_id, prompt_ids, max_tokens * params.n)
            engine = self.replicas[replica].engine  # the one that fails it, if one does
            accepted = []

            def took_it(accepted=accepted) -> None:
                accepted.append(True)
                if on_accepted is not None:
                    on_accepted()

            try:
                stream = self.replicas[replica].generate(
                    prompt, params, request_id, on_accepted=took_it
                )
                async with contextlib.aclosing(stream):
                    async for output in stream:
                        generated = sum(len(c.token_ids) for c in output.outputs)
                        self.router.progress(request_id, generated)
                        yield output
                return
            except EngineDeadError as exc:
                self._mark_dead(replica, exc.message, engine)
                if accepted:
                    raise  # it ran there: its partial output is lost, say so
                logger.warning("replica %d is dead; routing request %s again", replica, request_id)
            finally:
                self.router.finish(request_id)

    def abort(self, request_id: str) -> None:
        replica = self.router.replica_of(request_id)
        if replica is not None:
            self.replicas[replica].abort(request_id)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self.lockstep is not None:  # all leave their lockstep together, none waits for one
            for replica in self.replicas:
                replica.request_stop()
        for replica in self.replicas:
            replica.shutdown(timeout)
        if self.join_server is not None:
            self.join_server.close()
        if self.lockstep is not None:
            self.lockstep.close()

    # -- internals -------------------------------------------------------------------------------

    def _note_deaths(self) -> None:
        """Bring the router up to date: replicas that stopped (or are restarting) out, replicas
        serving a new engine since they were marked dead back in."""
        if self.join_server is not None:
            for i, rejoined in self.join_server.take_rejoined().items():
                logger.warning("data-parallel replica %d rejoined: routing to it again", i)
                self.replicas[i] = rejoined  # the lost one's connection is closed already
                self._failed_engines.pop(i, None)
                self.router.revive(i)
        for i, replica in enumerate(self.replicas):
            error = replica.health_error()
            if error is not None and i not in self.router.dead:
                logger.error("data-parallel replica %d stopped: %s", i, error.message)
                self._mark_dead(i, error.message, replica.engine)
            elif (
                error is None
                and i in self.router.dead
                and replica.engine is not self._failed_engines.get(i)
            ):
                # A request may learn of a failure before the replica's health shows it: the
                # same engine clearing its health has not recovered; a new one has.
                logger.warning("data-parallel replica %d restarted: routing to it again", i)
                self.router.revive(i)
                self._failed_engines.pop(i, None)

    def _mark_dead(self, replica: int, reason: str, engine: LLMEngine | None) -> None:
        """Route nothing more to `replica` until it serves an engine other than `engine` (the
        one that failed: a request that learns of it late, after the restart, marks the
        replica dead only until the next look at its health)."""
        if replica not in self.router.dead:
            self._failed_engines[replica] = engine
        self.router.mark_dead(replica, reason)

    def _none_live_error(self) -> EngineDeadError:
        """No replica serves: retry shortly if one is restarting, else every one stopped."""
        restarting = [
            (i, error)
            for i, replica in enumerate(self.replicas)
            if isinstance(error := replica.health_error(), EngineRestartingError)
        ]
        if restarting:
            return EngineRestartingError(
                "no data-parallel replica serves; "
                + "; ".join(f"replica {i}: {error.message}" for i, error in restarting),
                "retry in a few seconds",
            )
        return self.router.none_live_error()

    def _with_token_ids(self, prompt: PromptType) -> tuple[PromptType, list[int]]:
        """The prompt with its token ids (tokenized once, here, for routing); a prompt that is
        not one goes as it is, for the replica to refuse by name."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt, list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        tokenizer = self.engine.tokenizer
        if isinstance(text, str) and tokenizer is not None:
            ids = tokenizer.encode(text)
            return {"prompt": text, "prompt_token_ids": ids}, ids
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt, prompt
        return prompt, []
