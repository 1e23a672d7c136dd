"""Engine clients: what the API server, the Ray Serve app and `LLM` call to run requests.
`protocol.EngineClient` is the interface (generate, abort, health_error, health, get_stats,
replica_states, shutdown), as vLLM's engine protocol; `async_llm.AsyncLLM` implements it for one
engine running in a thread of this process (core/supervisor.py), delivering each request's outputs
to the caller's asyncio queue, and engine/dp/ implements it for data-parallel replicas (DPAsyncLLM)
and a replica on another node (RemoteReplica). `factory.build_engine_client` builds the one an
EngineArgs asks for. Clients know asyncio; the engine core does not.
"""
