"""HTTP serving: FastAPI app (OpenAI + /generate), SSE streaming, Prometheus metrics, `serve` CLI."""
