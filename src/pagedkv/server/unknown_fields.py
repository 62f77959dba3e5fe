"""Refusing a request's top-level fields that its route does not define, by name.

Every route refuses a top-level field it cannot honour instead of ignoring
it: on a generating route an ignored field (`reasoning_effort`, Anthropic's
`thinking`) would leave the client believing it was applied, and on the routes
whose answer is about one exact input (explain, tokenize, detokenize) it would
make the answer about a different input than the one the client meant. The
request models keep unknown fields (`extra="allow"`) so that the route can
name the first one in a 400 and say where the body belongs. Rejected: pydantic's
`extra="forbid"`, whose message ("Extra inputs are not permitted") cannot point
a client that sent the other API's shape to the right route.
"""

from __future__ import annotations

from collections.abc import Collection

from pydantic import BaseModel

from pagedkv.server.http_errors import bad_request


def refuse_unknown_fields(
    body: BaseModel, route: str, what: str, hint: str = "", allow: Collection[str] = ()
) -> None:
    """Raise APIError(400) naming the top-level fields `body`'s model does not define
    (`extra="allow"` keeps them in `model_extra`); `param` is the first. `hint`, a
    sentence, may say where such a body belongs. `allow`: names a route accepts
    without using them, because they cannot change its answer (a Messages body's
    generation fields sent to count_tokens)."""
    extra = [name for name in body.model_extra or {} if name not in allow]
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
