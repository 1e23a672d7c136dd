"""Launching: `launcher.Cluster` runs `cluster up/down/status/logs/exec` over one Transport per node
(`transport`: SSH through paramiko, or this machine). `up` probes every node read-only (`probe`,
with the pure `parsers`), collects every problem before acting (`preflight`, `invariants`), diffs
the planned containers (`node_launch`) against what runs (`up_diff`) and acts (`up_executor`; argv
lists from `commands`; `transfer` for air-gapped images and models), then reports (`launch_report`).
`local_node` is `cluster up --head/--worker` on this machine and `image` is `llmctl image build`.
`cluster_serve` is `serve -i`: it plans the layout, builds each node's `llmctl serve` argv and
starts the model server on the Ray backend (`head_server`) or the mp backend (`group_server`).
"""
