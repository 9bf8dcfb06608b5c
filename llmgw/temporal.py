"""Connecting to Temporal the one way every llmgw process does."""

from collections.abc import Sequence

from temporalio.client import Client, Interceptor
from temporalio.contrib.pydantic import pydantic_data_converter


async def connect(
    address: str, namespace: str = "default", interceptors: Sequence[Interceptor] = ()
) -> Client:
    """A client that carries llmgw's pydantic types (and traces, when given
    the tracing interceptor; workers built on the client inherit it)."""
    return await Client.connect(
        address,
        namespace=namespace,
        data_converter=pydantic_data_converter,
        interceptors=interceptors,
    )
