"""The Anthropic Messages API (`POST /v1/messages`), served by the same engine."""

from pagedkv.server.anthropic.routes import MessagesContext, add_messages_routes

__all__ = ["MessagesContext", "add_messages_routes"]
