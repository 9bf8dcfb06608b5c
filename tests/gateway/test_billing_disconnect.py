"""A non-streamed request whose client leaves is billed what the engine
generated when that can be known, else its reservation (router/forwarding/proxy.py).

llama.cpp finishes such a request regardless, so the router awaits its
answer and bills its usage (the replica counts as busy until then); vLLM
aborts on the closed connection, so the router lets go at once and bills the
reservation: the prompt estimate and every token the request could have had.
Before, both were billed the prompt estimate alone.
"""

import asyncio
import json
from pathlib import Path

from llmgw.types import EngineKind, ModelSpec
from router.api.reservation import estimate as prompt_estimate
from router.api.reservation import reserved_tokens
from router.api.schemas import ChatCompletionRequest
from router.billing import usage
from tests.gateway_util import PROMPT_TOKENS, Gateway, MockEngine, gateway, post_scope, ready, spec

M = "m1"
MAX_TOKENS = 40
BODY = {"model": M, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "hi"}]}


class Left:
    """A client that sent its request and left: ``answer`` is the router's
    handling of it, ``seen`` returns once the router has taken the disconnect in."""

    def __init__(self, key_id: int, answer: "asyncio.Task[None]") -> None:
        self.key_id = key_id
        self.answer = answer
        self.watchers: list[asyncio.Task[object]] = []

    async def seen(self) -> None:
        """Until the task that read the disconnect has ended and its done
        callbacks (the router's reaction) have run."""
        async with asyncio.timeout(5):
            while not self.watchers or not all(t.done() for t in self.watchers):
                await asyncio.sleep(0.005)
        # Done callbacks were scheduled when the task ended: one scheduled now runs after them.
        barrier = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(barrier.set_result, None)
        await barrier


async def leave_mid_request(gw: Gateway, engine: MockEngine) -> Left:
    """A client that sends the request, then leaves while the engine generates."""
    key_id, key = gw.key()
    body = json.dumps(BODY).encode()
    gone = asyncio.Event()
    read: list[bytes] = []
    left: Left

    async def receive() -> dict[str, object]:
        if not read:
            read.append(body)
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        task = asyncio.current_task()
        assert task is not None
        left.watchers.append(task)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        pass

    scope = post_scope("/v1/chat/completions", key)
    answer = asyncio.create_task(gw.app(scope, receive, send))  # type: ignore[arg-type]
    left = Left(key_id, answer)
    async with asyncio.timeout(5):
        while not engine.seen:
            await asyncio.sleep(0.01)
    gone.set()
    return left


def inflight(gw: Gateway) -> int:
    return sum(r.inflight for rs in gw.app.state.deps.table.routes.values() for r in rs)


async def billed(gw: Gateway, key_id: int) -> tuple[int, int, int, int]:
    await gw.app.state.deps.accountant.flush()
    [row] = usage.query(gw.store, key_id=key_id)
    return row.requests, row.errors, row.prompt_tokens, row.completion_tokens


def model(engine: EngineKind) -> ModelSpec:
    return spec(M).model_copy(update={"engine": engine})


async def test_llama_cpp_is_billed_what_it_generated(tmp_path: Path) -> None:
    engine = MockEngine(hold=asyncio.Event())  # "generates" until told
    replicas = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", replicas, [model(EngineKind.LLAMA_CPP)], engine) as gw:
        left = await leave_mid_request(gw, engine)
        key_id, answer = left.key_id, left.answer
        # The router took the disconnect in and does not let go...
        await left.seen()
        assert not answer.done() and inflight(gw) == 1  # ...the engine is still busy
        assert engine.hold is not None
        engine.hold.set()  # it finishes: its usage says what it generated
        async with asyncio.timeout(5):
            await answer
        assert inflight(gw) == 0
        # The mock engine generates max_tokens (PROMPT_TOKENS of prompt).
        assert await billed(gw, key_id) == (1, 1, PROMPT_TOKENS, MAX_TOKENS)  # 499: gone


async def test_vllm_is_let_go_and_billed_the_reservation(tmp_path: Path) -> None:
    engine = MockEngine(hold=asyncio.Event())
    replicas = [ready("r1", M, "http://e1:1")]
    async with gateway(tmp_path / "s.db", replicas, [model(EngineKind.VLLM)], engine) as gw:
        left = await leave_mid_request(gw, engine)
        key_id, answer = left.key_id, left.answer
        async with asyncio.timeout(5):
            await answer  # let go without the engine's answer
        assert inflight(gw) == 0
        parsed = ChatCompletionRequest.model_validate(BODY)
        estimate, reserved = prompt_estimate(parsed), reserved_tokens(parsed, 512)
        assert reserved == estimate + MAX_TOKENS
        assert await billed(gw, key_id) == (1, 1, estimate, MAX_TOKENS)
        assert engine.hold is not None
        engine.hold.set()
