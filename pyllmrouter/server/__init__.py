"""HTTP interface: OpenAI-compatible and llama-server router-compatible."""

from .app import create_app

__all__ = ["create_app"]
