"""OpenAI-compatible HTTP server (`portside serve`): FastAPI app over the async engine."""
