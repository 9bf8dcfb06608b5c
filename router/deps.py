"""What request handlers need, built once in ``create_app`` and passed down."""

from dataclasses import dataclass

from fastapi import Request

from router.auth import KeyVerifier
from router.proxy import Proxy
from router.routing import RoutingTable


@dataclass
class Deps:
    """The router's dependencies."""

    table: RoutingTable
    keys: KeyVerifier
    proxy: Proxy


async def get_deps(request: Request) -> Deps:
    """FastAPI dependency: the app's Deps.

    Async on purpose: FastAPI runs a plain ``def`` dependency in its thread
    pool, a thread hop on every request.
    """
    deps: Deps = request.app.state.deps
    return deps
