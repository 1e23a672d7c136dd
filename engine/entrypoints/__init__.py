"""How programs reach the engine: `llm.LLM`, the offline API in vLLM's shape (generate, chat), which
runs its batch through the same engine client as the server; `openai/`, the OpenAI-compatible HTTP
server of `llmctl serve`; and `ray_serve_app`, the same routes as a Ray Serve application (what
`llmctl plan --emit rayservice` deploys). Each builds its engine with engine/client/factory.py and
talks to it only through the EngineClient protocol.
"""
