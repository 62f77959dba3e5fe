"""Tool calling: the call formats of model families, and choosing one for a chat template."""

from pagedkv.server.tools.calls import ParsedOutput, ToolCall, ToolCallParser
from pagedkv.server.tools.select import PARSERS, ToolSupport, tool_support

__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolCallParser", "ToolSupport", "tool_support"]
