"""`llmctl bench`'s library: vLLM's throughput, latency and serve benchmarks, with what each run
reached of the device's limit.

`datasets` makes the random requests; `device_limit` says what the device can do at most (memory
bandwidth and matmul FLOP/s: a spec table for known GPUs, measured otherwise); `roofline` counts
the bytes a decode step reads and the FLOPs a prefill does, from the model's shape as the planner
counts it; `throughput`, `latency` and `serve` run the workloads and return vLLM's result keys.
The CLI (cli/bench.py) only parses, calls these and renders.
"""
