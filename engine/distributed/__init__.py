"""Distributed state: `ranks` (the rank mesh, built in one place, `reshape(pp, tp)`, and which ranks
each node runs), `parallel_state` (the tensor-, pipeline-, expert- and data-parallel process groups
built from that mesh; Gloo on the CPU, NCCL on CUDA), `partition` (how ranks share heads, MLP
columns, the vocabulary and the pipeline's layers, unevenly when tp does not divide),
`shm_communicator` (all-reduce and gather through shared memory between the ranks of one node),
`join` (the one authenticated join protocol of every connection between nodes: both sides prove
the cluster secret before anything is read), `rendezvous` (how the nodes of an mp group join node 0
without Ray, over it) and `ports`.
"""
