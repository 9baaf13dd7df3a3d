"""OpenAI-compatible HTTP server (FastAPI + an engine thread)."""
