"""HTTP interface: OpenAI-compatible and llama-server router-compatible."""

from pyllmrouter.server.app import create_app

__all__ = ["create_app"]
