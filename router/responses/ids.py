"""The ids of Responses objects, in OpenAI's shapes, from :mod:`secrets`.

Made by the router or an activity, never inside a workflow (where they would
have to come from ``workflow.uuid4()`` to replay). The shapes follow OpenAI's
(a prefix and random hex or base62); clients treat them as opaque strings.
"""

import re
import secrets
import string

_BASE62 = string.digits + string.ascii_letters


def _base62(n: int) -> str:
    return "".join(secrets.choice(_BASE62) for _ in range(n))


def response_id() -> str:
    """A response's id: ``resp_`` and 48 hex digits."""
    return f"resp_{secrets.token_hex(24)}"


# What every response id looks like (``response_id``; base62, as tests' and
# other stores' ids may be, not only hex).
_RESPONSE_ID = re.compile(r"resp_[0-9A-Za-z]{1,64}")


def is_response_id(text: str) -> bool:
    """Whether ``text`` has a response id's shape. Text without it names no
    response and is never sent to the store: PostgreSQL refuses a NUL in a
    text parameter with an error, not an empty answer, which the request
    path reads as the store failing (a 503 for a client's made-up id)."""
    return _RESPONSE_ID.fullmatch(text) is not None


def message_id() -> str:
    """A message item's id: ``msg_`` and 32 hex digits."""
    return f"msg_{secrets.token_hex(16)}"


def function_call_id() -> str:
    """A function-call item's id: ``fc_`` and 32 hex digits."""
    return f"fc_{secrets.token_hex(16)}"


def function_call_output_id() -> str:
    """A function-call-output item's id (given when it is stored): ``fco_`` and 32 hex."""
    return f"fco_{secrets.token_hex(16)}"


def call_id() -> str:
    """A tool call's ``call_id``, when the engine gave none: ``call_`` and 24 base62."""
    return f"call_{_base62(24)}"
