"""The doctor: each node's facts (`node_facts`, collected by the launcher's probe) checked by pure
functions (`doctor_checks`, on the same invariants as `cluster up`'s preflight), and the all-reduce
check (`collective_check`, its results in `collective_report`, NCCL's transport read by `nccl_log`)
run on the engine's executors with bare workers: on this machine, across a Ray cluster
(`ray_doctor`), against an inventory from inside its head container (`cluster_doctor`), or on an mp
cluster over its rendezvous (`mp_doctor`).
"""
