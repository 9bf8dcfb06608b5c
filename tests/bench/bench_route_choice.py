"""Cache-aware routing's own CPU per request (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_route_choice [--number 2000] [--repeat 15]

In-process, without HTTP or an engine: what the router adds for a model's
request between its admission and its reply, for 1, 2 and 4 replicas and
two prompts (bench_router's one-line chat, and a ~1,300-token chat of a
system prompt and five turns): the prompt key (router/api/openai.py
``_prompt_key``, the body parsed by orjson and hashed in chunks), the
Affinity's ordering and the metrics (Proxy._choose), and what the engine
served folded back in (Proxy._served, with a usage that reports cached
tokens). The best of ``--repeat`` rounds of ``--number`` requests: the noise
of a shared machine only ever adds. bench_router measures the whole request.
"""

import argparse
import timeit
from typing import Any, cast

import orjson

from llmgw.types import ReplicaMemo, ReplicaPhase
from router.affinity.affinity import Affinity
from router.api.openai import _prompt_key
from router.api.schemas import ChatCompletionRequest
from router.billing.bill import Bill
from router.common.metrics import Metrics
from router.control_link.routing import RoutingTable
from router.forwarding.call import Call
from router.forwarding.engine_stream import Usage
from router.forwarding.proxy import Proxy
from router.forwarding.upstream import Upstream

MODEL = "m"
SYSTEM = "You are a helpful assistant. " * 140
PROMPTS: dict[str, dict[str, Any]] = {
    "one line": {"messages": [{"role": "user", "content": "Say ok."}]},
    "1.3k-token chat": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            *(
                {"role": "user" if i % 2 == 0 else "assistant", "content": f"question {i} " * 40}
                for i in range(5)
            ),
        ]
    },
}
# What an ASGI server hands the router: the headers a client sends.
SCOPE: dict[str, Any] = {
    "headers": [
        (b"host", b"127.0.0.1"),
        (b"authorization", b"Bearer key"),
        (b"content-type", b"application/json"),
        (b"content-length", b"100"),
    ]
}


def per_request_us(replicas: int, prompt: dict[str, Any], number: int, repeat: int) -> float:
    """The best microseconds per request of key, choice and record."""
    raw = orjson.dumps({"model": MODEL, "max_tokens": 16, **prompt})
    body = ChatCompletionRequest.model_validate_json(raw)
    table = RoutingTable()
    memos = [
        ReplicaMemo(
            replica_id=f"r{i}", model=MODEL, phase=ReplicaPhase.READY, endpoint=f"http://e{i}:1"
        )
        for i in range(replicas)
    ]
    table.update(memos, {})
    # Nothing is sent: no upstream client is needed.
    proxy = Proxy(cast(Upstream, None), table, lambda _: "k", Metrics(table), affinity=Affinity())
    usage = Usage(300, 100)

    def one() -> None:
        routes = len(table.routes.get(MODEL, ()))
        key = _prompt_key(None, SCOPE, raw, body, 1, routes)
        call = Call(
            model=MODEL, path="/v1/chat/completions", body=raw, stream=False,
            strip_usage=False, bill=Bill(), started=0.0, traced=False, prompt_key=key,
        )  # fmt: skip
        choice = proxy._choose(call, table.candidates(MODEL))
        proxy._served(choice.order[0], call, choice, usage)

    return min(timeit.repeat(one, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=2000, help="requests per round")
    p.add_argument("--repeat", type=int, default=15, help="rounds; the best is shown")
    args = p.parse_args()
    for name, prompt in PROMPTS.items():
        for replicas in (1, 2, 4):
            us = per_request_us(replicas, prompt, args.number, args.repeat)
            print(f"{name:>16}, {replicas} replica(s): {us:6.1f} us a request", flush=True)


if __name__ == "__main__":
    main()
