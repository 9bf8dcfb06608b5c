"""The OpenAI Agents SDK (``openai-agents``), a real agent framework, through
the router to a real llama.cpp engine serving the tiny model: an agent with a
function tool, run through Responses and through Chat Completions, streamed
and not, completes with a final output.

The tiny model never stops on its own, and the SDK takes a response cut at
``max_output_tokens`` for an error; so the prompts carry the tiny model's
triggers (llmgw_cli/dev/triggers.py). A user's message with ``TOOL`` makes
it call the tool, and the tool's answer (with ``FINISH``) makes it say a final
word and stop; a user's message with ``FINISH`` makes it answer at once. The
router, uvicorn and the engine as in tests/gateway/test_admission_llama.py.
"""

from collections.abc import AsyncIterator

import openai
import pytest
from agents import (
    Agent,
    MessageOutputItem,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RawResponsesStreamEvent,
    RunConfig,
    RunItemStreamEvent,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
)
from agents.items import RunItem
from agents.models.interface import Model
from openai.types.responses import ResponseTextDeltaEvent

from llmgw_cli.dev import triggers
from tests.gateway.test_admission_llama import Engine, M, engine, model, router

__all__ = ["engine"]

ANSWER = "sunny"
TOOL_ASK = f"What is the weather? {triggers.TOOL}"
DIRECT_ASK = f"Say you are done. {triggers.FINISH}"
FINAL = triggers.FINISH_TEXT.strip()
# No traces sent to OpenAI's service (the SDK's default when it has an API key).
RUN = RunConfig(tracing_disabled=True)
APIS = ["responses", "chat"]


@function_tool(name_override=triggers.TOOL_NAME)
def lookup() -> str:
    """Look the weather up."""
    return f"{ANSWER} {triggers.FINISH}"


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[openai.AsyncOpenAI]:
    async with router(engine, model()) as r, r.client(r.key()) as client:
        yield client


def _agent(client: openai.AsyncOpenAI, api: str) -> Agent:
    chosen: Model = (
        OpenAIResponsesModel(model=M, openai_client=client)
        if api == "responses"
        else OpenAIChatCompletionsModel(model=M, openai_client=client)
    )
    return Agent(
        name="tiny",
        instructions="Answer with the lookup tool.",
        tools=[lookup],
        model=chosen,
        # Bounds each turn should a trigger fail (the SDK then raises: incomplete).
        model_settings=ModelSettings(max_tokens=64),
    )


def _kinds(items: list[RunItem]) -> list[type]:
    return [type(item) for item in items]


def _called_then_answered(items: list[RunItem]) -> None:
    assert _kinds(items) == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    call, output, _ = items
    assert isinstance(call, ToolCallItem) and isinstance(output, ToolCallOutputItem)
    assert getattr(call.raw_item, "name", None) == triggers.TOOL_NAME
    assert output.output == f"{ANSWER} {triggers.FINISH}"


@pytest.mark.parametrize("api", APIS)
async def test_agent_calls_the_tool_and_finishes(client: openai.AsyncOpenAI, api: str) -> None:
    result = await Runner.run(_agent(client, api), TOOL_ASK, run_config=RUN)
    _called_then_answered(result.new_items)
    assert result.final_output.strip() == FINAL


@pytest.mark.parametrize("api", APIS)
async def test_agent_streamed_calls_the_tool_and_finishes(
    client: openai.AsyncOpenAI, api: str
) -> None:
    result = Runner.run_streamed(_agent(client, api), TOOL_ASK, run_config=RUN)
    events = [e async for e in result.stream_events()]
    assert result.is_complete
    _called_then_answered(result.new_items)
    assert result.final_output.strip() == FINAL
    names = [e.name for e in events if isinstance(e, RunItemStreamEvent)]
    assert names == ["tool_called", "tool_output", "message_output_created"]
    # The text came as the engine streamed it, not only in the end.
    raw = [e.data for e in events if isinstance(e, RawResponsesStreamEvent)]
    deltas = [d for d in raw if isinstance(d, ResponseTextDeltaEvent)]
    assert "".join(d.delta for d in deltas).strip() == FINAL


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("api", APIS)
async def test_agent_with_a_tool_may_answer_at_once(
    client: openai.AsyncOpenAI, api: str, streamed: bool
) -> None:
    """The other ending the SDK takes for an agent with a function tool: a final
    text message, no tool call."""
    agent = _agent(client, api)
    if streamed:
        running = Runner.run_streamed(agent, DIRECT_ASK, run_config=RUN)
        [_ async for _ in running.stream_events()]
        items, final = running.new_items, running.final_output
    else:
        result = await Runner.run(agent, DIRECT_ASK, run_config=RUN)
        items, final = result.new_items, result.final_output
    assert _kinds(items) == [MessageOutputItem]
    assert final.strip() == FINAL
