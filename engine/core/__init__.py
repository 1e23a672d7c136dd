"""The engine core, which knows nothing of asyncio or HTTP. `llm_engine.LLMEngine` validates and
queues requests and steps: `schedule()` -> `batch_queue.run()` (the executor;
`batch_queue.BatchQueue` keeps a pipeline's batches in flight) -> `postprocess()`.
`scheduler.Scheduler` (continuous batching, chunked prefill, preemption) and
`block_manager.BlockManager` (paged KV blocks, prefix caching) are pure Python; the step's messages
are `request`, `scheduler_output` and `model_runner_output`; `output_processor.OutputProcessor` and
the incremental `detokenizer` turn token ids into RequestOutputs (text, stop strings, n > 1).
`engine_core.EngineCore` is the busy loop (drain commands, step, deliver outputs; data-parallel
lockstep), `supervisor.EngineSupervisor` runs it in its own thread and handles failures and
restarts, and `stall_monitor.StallMonitor` and `watchdog.Watchdog` find and abort a stalled step.
"""
