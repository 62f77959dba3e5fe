"""Which tool-call format a chat template uses, and whether it can render tools at all."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.server.tools.calls import ToolCallParser
from pagedkv.server.tools.hermes import HermesParser
from pagedkv.server.tools.llama3 import Llama3JsonParser

PARSERS: dict[str, type[ToolCallParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}


@dataclass(frozen=True, slots=True)
class ToolSupport:
    """What the server can do with `tools` for the loaded model: `parser` is None
    with `reason` saying why tools are refused."""

    parser: ToolCallParser | None
    reason: str | None = None


def _renders_tools(template: str) -> bool:
    """True when the template reads the `tools` variable transformers passes it."""
    try:
        import jinja2
        from jinja2 import meta

        names = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except Exception:  # a template jinja cannot parse here: look for the name
        return "tools" in template
    return "tools" in names


def guess_parser(template: str) -> str | None:
    """The format a template documents to its model; None when it names none we know."""
    if "<tool_call>" in template:
        return HermesParser.name
    if "<|python_tag|>" in template or '"parameters"' in template or "ipython" in template:
        return Llama3JsonParser.name
    return None


def tool_support(template: str | None, flag: str | None) -> ToolSupport:
    """The parser for a model whose chat template is `template`; `flag` is
    `--tool-call-parser` (it wins over the guess, not over a template without tools)."""
    if flag is not None and flag not in PARSERS:
        raise ValueError(f"unknown tool-call parser {flag!r}; choose one of {sorted(PARSERS)}")
    if template is None:
        return ToolSupport(None, "the model has no chat template")
    if not _renders_tools(template):
        return ToolSupport(
            None,
            "the model's chat template does not render tools (it never reads the "
            "`tools` variable), so the model would never see them; use a model whose "
            "template supports tool calling",
        )
    name = flag or guess_parser(template)
    if name is None:
        return ToolSupport(
            None,
            "the model's chat template renders tools but names no tool-call format "
            f"pagedkv knows; start the server with --tool-call-parser ({', '.join(PARSERS)})",
        )
    return ToolSupport(PARSERS[name]())
