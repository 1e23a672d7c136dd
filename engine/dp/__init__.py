"""Data parallelism: several whole engines behind one endpoint. `dp_async_llm.DPAsyncLLM` runs the
`--data-parallel-size` replicas and is their EngineClient; `router.DPRouter` (pure) sends each
request to the replica with the least outstanding work, or to the one holding its prompt's prefix;
`lockstep.DPLockstep` makes replicas whose MoE layers share their experts (--enable-expert-parallel)
step together; `placement.DPPlacement` says which replicas run on this node under vLLM's multi-node
flags. Across nodes, the head's `join_server.DPJoinServer` accepts the replicas of --headless nodes
(`replica_server.ReplicaServer`) and the router drives each through a `remote_replica.RemoteReplica`
as it drives a local one.
"""
