"""The doctor: node facts and invariant checks (`llmctl doctor`), and the all-reduce check run on
the engine's executors (`llmctl doctor nccl`), with its diagnoses."""
