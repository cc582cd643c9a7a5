"""The OpenAI-compatible HTTP layer over the streaming core: routes, vLLM's request and response shapes, tools, reasoning and structured outputs."""
