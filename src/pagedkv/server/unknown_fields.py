"""Refusing a request's top-level fields that its route does not define, by name.

The routes whose answer is about one exact input (explain, tokenize,
detokenize) refuse what they cannot use instead of ignoring it, as the
generating routes do for newer clients' fields: an ignored field there would
make the answer about a different input than the one the client meant. Their
models keep unknown fields (`extra="allow"`) so that the route can name the
first one in a 400 and say where the body belongs. Rejected: pydantic's
`extra="forbid"`, whose message ("Extra inputs are not permitted") cannot point
a client that sent the other API's shape to the right route.
"""

from __future__ import annotations

from pydantic import BaseModel

from pagedkv.server.http_errors import bad_request


def refuse_unknown_fields(body: BaseModel, route: str, what: str, hint: str = "") -> None:
    """Raise APIError(400) naming the top-level fields `body`'s model does not define
    (`extra="allow"` keeps them in `model_extra`); `param` is the first. `hint`, a
    sentence, may say where such a body belongs."""
    extra = list(body.model_extra or {})
    if not extra:
        return
    names = ", ".join(repr(name) for name in extra[:8]) + (", ..." if len(extra) > 8 else "")
    fields = "fields" if len(extra) > 1 else "field"
    raise bad_request(
        f"{extra[0]}: {route} cannot use the {fields} {names}: it takes {what}, and "
        f"refuses the fields it cannot use rather than drop them.{' ' + hint if hint else ''}",
        extra[0],
        code="unknown_field",
    )
