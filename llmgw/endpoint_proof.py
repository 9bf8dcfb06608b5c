"""The endpoint proof: how a replica's endpoint shows the router that it holds
the replica's engine key, without the key (or a prompt) ever going to it.

A Replica memo is written by whoever can start a workflow, and under
``llmgw up`` that includes any local user (the dev server is unauthenticated
on loopback). So the router sends a new endpoint a nonce on :data:`PROOF_PATH`
first; the pass-through in front of the engine (worker_agent/passthrough.py)
answers :func:`answer` over the nonce and *its own* listen address, and only
an endpoint whose answer checks out is routed to (router/control_link/endpoint_proof.py).

The address is in the MAC so a relay proves nothing: a forged endpoint that
forwards the challenge to the real pass-through gets back an answer for the
real address, not for its own. That holds for IP addresses only: the
pass-through MACs the *name* it was told to listen on, and a host name may
resolve elsewhere for the router (where a relay passes the answer on), so
the router proves, and routes to, only endpoints whose host is an IP
literal (:func:`ip_literal`).
"""

import hashlib
import hmac
import ipaddress
import re
from urllib.parse import urlsplit

# Not a path any engine serves; answered by the pass-through without the key.
PROOF_PATH = "/_llmgw/endpoint-proof"
NONCE_PARAM = "nonce"
_NONCE = re.compile(r"[0-9a-f]{32,128}")
_CONTEXT = b"llmgw-endpoint-proof/1"


def valid_nonce(nonce: str) -> bool:
    """Whether ``nonce`` is one a router makes (lowercase hex, 128 to 512 bits)."""
    return _NONCE.fullmatch(nonce) is not None


def address(host: str, port: int) -> str:
    """The form of an endpoint's address both sides put in the MAC."""
    return f"{host.strip('[]').lower()}:{port}"


def endpoint_address(endpoint: str) -> str | None:
    """The address of an ``http://HOST:PORT`` endpoint; None for anything else."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "http" or not parts.hostname or port is None:
        return None
    return address(parts.hostname, port)


def ip_literal(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (bracketed or not), not a name."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def answer(engine_key: str, listen_address: str, nonce: str) -> str:
    """What the holder of ``engine_key``, listening on ``listen_address``, answers."""
    message = b"\n".join((_CONTEXT, listen_address.encode(), nonce.encode()))
    return hmac.new(engine_key.encode(), message, hashlib.sha256).hexdigest()
