"""The OpenAI-compatible HTTP server of `llmctl serve`, over an EngineClient. `api_server` builds
the FastAPI app (completions, chat completions, models, health, version, metrics) and runs it
(`run_server`); `http_server` is uvicorn with timeouts for clients that stall and a SIGTERM that
drains first; `request_body` reads bodies bounded in size and time and decodes them strictly;
`protocol` holds the request bodies and the sampling parameters they ask for (fields not implemented
are refused, by name); `serving`, `serving_completions` and `serving_chat` prepare a request off the
event loop, run it and stream or return it; `server_config`, `errors` (OpenAI's error JSON) and
`metrics` (Prometheus) complete it.
"""
