"""Connecting to Temporal the one way every llmgw process does."""

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter


async def connect(address: str, namespace: str = "default") -> Client:
    """A client that carries llmgw's pydantic types."""
    return await Client.connect(
        address, namespace=namespace, data_converter=pydantic_data_converter
    )
