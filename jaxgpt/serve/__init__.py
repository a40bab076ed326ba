"""jaxgpt-serve's parts: the OpenAI-compatible app (`create_app`) and the engine thread (`EngineWorker`).
Needs the `serve` extra (fastapi, uvicorn, prometheus_client)."""

from jaxgpt.serve.app import create_app
from jaxgpt.serve.worker import EngineWorker

__all__ = ["EngineWorker", "create_app"]
