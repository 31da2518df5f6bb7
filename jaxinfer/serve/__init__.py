"""jaxinfer's OpenAI-compatible HTTP server (FastAPI + uvicorn): `python -m
jaxinfer.launch.serve`, or in-process with ServerThread. See docs/serving.md."""

from jaxinfer.serve.app import ServeConfig, ServeState, create_app
from jaxinfer.serve.engine_loop import EngineLoop, Submission
from jaxinfer.serve.metrics import ServerMetrics
from jaxinfer.serve.server import ServerThread, free_port, make_server, serve_forever

__all__ = ["ServeConfig", "ServeState", "create_app", "EngineLoop", "Submission",
           "ServerMetrics", "ServerThread", "free_port", "make_server", "serve_forever"]
