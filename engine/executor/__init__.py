"""Executors: how the engine runs a call on every rank. `base.Executor` is the one contract
(`collective_rpc`, `execute_model` returning a future, `check_alive`, `abort`) and picks the backend
(`get_class`, vLLM's rule): `uniproc` runs the one worker in the engine's process, `multiproc` one
worker process per rank (its wire protocol is in its docstring), `ray` one Ray actor per rank in a
placement group. `node_agent` is a --headless node's part of an mp group across nodes: its workers,
which node 0's MultiprocExecutor drives as its own. Without a model config the executors start bare
workers (the doctor's all-reduce check).
"""
