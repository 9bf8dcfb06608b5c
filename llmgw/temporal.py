"""Connecting to Temporal the one way every llmgw process does."""

import asyncio
from collections.abc import Sequence

from temporalio.client import Client, Interceptor
from temporalio.contrib.pydantic import pydantic_data_converter


async def connect(
    address: str,
    namespace: str = "default",
    interceptors: Sequence[Interceptor] = (),
    wait_s: float = 30.0,
) -> Client:
    """A client that carries llmgw's pydantic types (and traces, when given
    the tracing interceptor; workers built on the client inherit it).

    A server that is starting listens before it serves ("Frontend is not
    healthy yet", status Unavailable): that is waited out for ``wait_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return await Client.connect(
                address,
                namespace=namespace,
                data_converter=pydantic_data_converter,
                interceptors=interceptors,
            )
        except RuntimeError as exc:
            if "Unavailable" not in str(exc) or loop.time() >= deadline:
                raise
            await asyncio.sleep(0.25)
