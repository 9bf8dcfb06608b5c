"""Engine liveness without processes: the verdict (worker_agent/liveness.py)
fed observations, the per-engine probes as data (worker_agent/probes.py),
and the watch's wiring over a scripted supervisor and an engine answering
through httpx's MockTransport."""

import asyncio
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from llmgw.errors import AgentShutdown
from llmgw.types import ShardRef, WatchShardInput
from tests.harness import engine_cache
from worker_agent.liveness import (
    ENGINE_HUNG,
    Alive,
    Hung,
    Liveness,
    LivenessRules,
    Observation,
    Suspect,
)
from worker_agent.probes import LIVENESS_PROBES, liveness_probe, metric_values, probe_liveness
from worker_agent.shard_record import ShardRecord
from worker_agent.shard_service import RunningShards
from worker_agent.supervisor import RunningShard, StopOutcome

UNANSWERED = Observation(answered=False, why="no answer within 10s")
IDLE = Observation(answered=True, in_flight=0, progress=5)


def busy(progress: float, in_flight: float = 1) -> Observation:
    return Observation(answered=True, in_flight=in_flight, progress=progress)


def feed(rules: LivenessRules, rounds: Sequence[tuple[float, Observation]]) -> list[object]:
    state = Liveness(rules)
    return [state.observe(seen, at) for at, seen in rounds]


# --- the verdict ------------------------------------------------------------


def test_unanswered_rounds_are_hung_only_when_enough_and_long_enough() -> None:
    rules = LivenessRules(rounds=3, unanswered_s=30, stall_s=0)
    verdicts = feed(rules, [(t, UNANSWERED) for t in (0, 10, 20, 30)])
    assert verdicts[:3] == [
        Suspect(1, 3, "no answer within 10s"),
        Suspect(2, 3, "no answer within 10s"),
        Suspect(3, 3, "no answer within 10s"),  # three rounds, but 20 s only
    ]
    hung = verdicts[3]
    assert isinstance(hung, Hung) and hung.reason.startswith(ENGINE_HUNG)
    assert "4 times over 30s" in hung.reason and "no answer within 10s" in hung.reason
    assert Suspect(2, 6, "x").detail == "liveness: 2/6 unanswered (x)"


def test_a_span_counts_from_the_first_round_asked_to_the_last_one_given_up() -> None:
    state = Liveness(LivenessRules(rounds=2, unanswered_s=15, stall_s=0))
    assert isinstance(state.observe(UNANSWERED, at=10, asked_at=0), Suspect)
    assert isinstance(state.observe(UNANSWERED, at=20, asked_at=10), Hung)


def test_one_slow_answer_among_good_ones_resets_the_count() -> None:
    rules = LivenessRules(rounds=3, unanswered_s=0, stall_s=0)
    ok = Observation(answered=True)
    pattern = [UNANSWERED, UNANSWERED, ok, UNANSWERED, UNANSWERED, ok] * 20
    verdicts = feed(rules, [(10.0 * i, seen) for i, seen in enumerate(pattern)])
    assert not any(isinstance(v, Hung) for v in verdicts)
    assert {v.unanswered for v in verdicts if isinstance(v, Suspect)} == {1, 2}


def test_a_long_busy_stretch_with_progress_is_never_hung() -> None:
    rules = LivenessRules(rounds=2, unanswered_s=10, stall_s=60)
    # An hour of work: the figure moves every few rounds (a big batch of
    # prompt in between), and now and then one slow answer.
    rounds: list[tuple[float, Observation]] = []
    for i in range(360):
        seen = busy(progress=i // 4, in_flight=1 + i % 3)
        rounds.append((10.0 * i, UNANSWERED if i % 17 == 0 else seen))
    verdicts = feed(rules, rounds)
    assert not any(isinstance(v, Hung) for v in verdicts)
    assert any(isinstance(v, Alive) and "no progress for" in v.detail for v in verdicts)


def test_work_in_flight_without_progress_is_hung_after_the_stall_time() -> None:
    rules = LivenessRules(rounds=0, stall_s=60)
    verdicts = feed(rules, [(0, busy(7)), (30, busy(7)), (59, busy(7)), (60, busy(7, 2))])
    assert all(isinstance(v, Alive) for v in verdicts[:3])
    hung = verdicts[3]
    assert isinstance(hung, Hung) and hung.reason.startswith(ENGINE_HUNG)
    assert "2 requests in flight" in hung.reason and "(7)" in hung.reason and "60s" in hung.reason


def test_a_stall_clock_restarts_when_the_engine_goes_idle_or_moves() -> None:
    rules = LivenessRules(rounds=0, stall_s=60)
    # Idle at 50 s: the same figure with new work later is a new stretch.
    idle_between = [(0, busy(7)), (50, IDLE), (60, busy(7)), (110, busy(7))]
    assert not any(isinstance(v, Hung) for v in feed(rules, idle_between))
    moved = [(0, busy(7)), (50, busy(8)), (100, busy(8))]
    assert not any(isinstance(v, Hung) for v in feed(rules, moved))
    # Unanswered rounds between do not restart it.
    gaps = [(0, busy(7)), (30, UNANSWERED), (61, busy(7))]
    assert isinstance(feed(rules, gaps)[-1], Hung)


def test_an_engine_that_does_not_tell_its_work_cannot_stall() -> None:
    rules = LivenessRules(rounds=0, stall_s=1)
    silent = Observation(answered=True)
    no_progress = Observation(answered=True, in_flight=3, progress=None)
    verdicts = feed(rules, [(0, silent), (100, no_progress), (200, no_progress)])
    assert all(isinstance(v, Alive) for v in verdicts)


def test_rules_at_zero_are_off() -> None:
    off = LivenessRules(rounds=0, unanswered_s=0, stall_s=0)
    hours = [(10.0 * i, UNANSWERED if i % 2 else busy(1)) for i in range(1000)]
    verdicts = feed(off, hours)
    assert not any(isinstance(v, Hung) for v in verdicts)
    # Unanswered rounds still show as suspicion, with no bound to reach.
    assert Suspect(3, 0, "x").detail == "liveness: 3 unanswered (x)"


# --- the probes, as data -------------------------------------------------------

METRICS = """\
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 186
llamacpp:requests_processing 1
llamacpp:requests_deferred 2
vllm:num_requests_running{engine="0",model_name="a b"} 2.0
vllm:num_requests_running{engine="1",model_name="a b"} 1.0
vllm:prompt_tokens_total{engine="0"} 1.5e3 1700000000000
vllm:prompt_tokens_created{engine="0"} 1.7e9
broken line
"""


def test_metric_values_sum_labelled_lines_and_match_names_exactly() -> None:
    values = metric_values(METRICS)
    assert values["llamacpp:n_decode_total"] == 186
    assert values["vllm:num_requests_running"] == 3
    assert values["vllm:prompt_tokens_total"] == 1500  # the timestamp is not the value
    assert values["vllm:prompt_tokens_created"] == 1.7e9


def test_each_engine_is_asked_through_its_work_loop() -> None:
    llama = liveness_probe("llama.cpp")
    # /health is answered by llama-server's HTTP thread alone; /metrics by its task loop.
    assert llama.path == "/metrics" and llama.progress == ("llamacpp:n_decode_total",)
    assert liveness_probe("vllm").in_flight[0] == "vllm:num_requests_running"
    # SGLang's plan enables no metrics: its scheduler is asked for one token.
    sglang = liveness_probe("sglang")
    assert sglang.path == "/health_generate" and not sglang.in_flight and not sglang.progress
    assert liveness_probe("something-new").path == "/health"


def test_the_vllm_names_are_the_installed_vllms() -> None:
    found = sorted(engine_cache().glob("vllm/*/lib/python3.*/site-packages/vllm/v1/metrics"))
    if not found:
        pytest.skip("no vLLM installed in the tests' engine cache")
    source = "".join(p.read_text() for p in found[0].glob("*.py"))
    probe = LIVENESS_PROBES["vllm"]
    for name in probe.in_flight + probe.progress:
        # prometheus_client adds _total to a counter's name.
        assert f'name="{name.removesuffix("_total")}"' in source, name


def _engine(answer: httpx.Response | None, seen: list[str]) -> httpx.AsyncClient:
    async def reply(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.path} {request.headers['Authorization']}")
        if answer is None:
            await asyncio.sleep(3600)  # a frozen engine: the probe's bound ends it
        assert answer is not None
        return answer

    return httpx.AsyncClient(transport=httpx.MockTransport(reply))


async def test_a_probe_reads_work_and_progress_and_is_bounded() -> None:
    seen: list[str] = []
    probe = liveness_probe("llama.cpp")
    async with _engine(httpx.Response(200, text=METRICS), seen) as http:
        got = await probe_liveness(http, "http://e", "k", probe, 5)
    assert got == Observation(answered=True, in_flight=3, progress=186)
    assert seen == ["/metrics Bearer k"]
    async with _engine(None, []) as http:
        async with asyncio.timeout(60):
            frozen = await probe_liveness(http, "http://e", "k", probe, 0.2)
    assert frozen == Observation(answered=False, why="no answer within 0.2s")
    async with _engine(httpx.Response(503), []) as http:
        refused = await probe_liveness(http, "http://e", "k", liveness_probe("sglang"), 5)
    assert refused == Observation(answered=False, why="/health_generate 503")
    async with _engine(httpx.Response(200, text="llamacpp:n_decode_total 3\n"), []) as http:
        untold = await probe_liveness(http, "http://e", "k", probe, 5)
    assert untold == Observation(answered=True, progress=3)  # no in-flight figure: no stall


async def test_an_engine_without_the_probed_path_is_asked_its_fallback() -> None:
    """llama-server without --metrics answers 501 from its HTTP thread: that
    says nothing of its task loop, and must not count as unanswered."""
    seen: list[str] = []

    async def reply(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/metrics":
            return httpx.Response(501)
        return httpx.Response(health.pop(0))

    health = [200, 503]
    async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as http:
        probe = liveness_probe("llama.cpp")
        first = await probe_liveness(http, "http://e", "k", probe, 5)
        second = await probe_liveness(http, "http://e", "k", probe, 5)
    assert first == Observation(answered=True)
    assert second == Observation(answered=False, why="/health 503")
    assert seen == ["/metrics", "/health", "/metrics", "/health"]


async def test_a_probe_reads_a_bounded_part_of_an_answer() -> None:
    # Figures past the first 4 MiB are never read (nor held in memory).
    flood = "# " + "x" * 100 + "\n"
    text = flood * (5 * 2**20 // len(flood)) + METRICS
    async with _engine(httpx.Response(200, text=text), []) as http:
        got = await probe_liveness(http, "http://e", "k", liveness_probe("llama.cpp"), 30)
    assert got == Observation(answered=True)


# --- the watch's wiring ----------------------------------------------------------

REF = ShardRef(replica_id="r-9", rank=0)


class Engines:
    """A supervisor whose engine runs until stopped."""

    def __init__(self, *, serves_http: bool = True) -> None:
        self.serves_http = serves_http
        self.calls: list[str] = []
        self.alive = True

    def find_running(self, ref: ShardRef) -> RunningShard | None:
        if not self.alive:
            return None
        return RunningShard(ref=ref, pid=4242, port=1, endpoint="http://e", log_path=Path("x"))

    def plan_of(self, ref: ShardRef) -> ShardRecord:
        return ShardRecord(model="tiny", engine="llama.cpp", serves_http=self.serves_http)

    def dead_sidecar(self, ref: ShardRef) -> tuple[str, int] | None:
        return None

    def exit_code(self, ref: ShardRef) -> int | None:
        return None

    def stopped_on_request(self, ref: ShardRef) -> bool:
        return not self.alive

    def log_tail(self, ref: ShardRef, lines: int) -> list[str]:
        return ["last words"]

    def trim_log(self, ref: ShardRef) -> bool:
        return False

    def stop(self, ref: ShardRef, grace_s: float) -> StopOutcome:
        self.calls.append("stop")
        self.alive = False
        return StopOutcome(was_running=True, exit_code=-9)

    def kill_leftovers(self, ref: ShardRef) -> list[int]:
        return []


FAST = LivenessRules(interval_s=0.01, timeout_s=0.05, rounds=3, unanswered_s=0, stall_s=0)


async def test_the_watch_stops_an_engine_that_no_longer_answers() -> None:
    engines = Engines()
    beats: list[str] = []
    asked: list[str] = []
    async with _engine(None, asked) as http:
        shards = RunningShards(engines, lambda _: "k", http, FAST)
        async with asyncio.timeout(60):
            ended = await shards.watch(
                WatchShardInput(shard=REF, poll_interval_s=0.01), beats.append
            )
    assert ended.reason.startswith(ENGINE_HUNG) and "3 times" in ended.reason
    assert ended.exit_code == -9 and ended.log_tail == ["last words"]
    assert engines.calls == ["stop"]
    assert set(asked) == {"/metrics Bearer k"} and len(asked) == 3
    assert "running; liveness: 1/3 unanswered (no answer within 0.05s)" in beats
    assert "running; liveness: 2/3 unanswered (no answer within 0.05s)" in beats
    # The process checks and heartbeats went on while each probe waited.
    assert beats.count("running") >= 1 and len(beats) > len(asked)


async def test_a_probe_that_fails_unexpectedly_is_an_unanswered_round_not_the_watchs_end() -> None:
    # A fault outside httpx's errors (here the transport raising) must not
    # end the watch with an exception, leaving a healthy engine unwatched.
    async def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("pool broke")

    engines = Engines()
    async with httpx.AsyncClient(transport=httpx.MockTransport(broken)) as http:
        shards = RunningShards(engines, lambda _: "k", http, FAST)
        async with asyncio.timeout(60):
            ended = await shards.watch(WatchShardInput(shard=REF, poll_interval_s=0.01), print)
    assert ended.reason.startswith(ENGINE_HUNG) and "RuntimeError: pool broke" in ended.reason


@pytest.mark.parametrize(
    ("engines", "rules"),
    [
        (Engines(serves_http=False), FAST),
        (Engines(), LivenessRules(interval_s=0, timeout_s=0.05, rounds=1, unanswered_s=0)),
    ],
    ids=["worker-rank", "probing-off"],
)
async def test_a_worker_rank_and_a_watch_with_probing_off_ask_nothing(
    engines: Engines, rules: LivenessRules
) -> None:
    asked: list[str] = []
    beats: list[str] = []
    async with _engine(None, asked) as http:
        shards = RunningShards(engines, lambda _: "k", http, rules)
        with pytest.raises(AgentShutdown):
            await shards.watch(
                WatchShardInput(shard=REF, poll_interval_s=0.01),
                beats.append,
                lambda: len(beats) >= 30,  # many probe intervals
            )
    assert asked == [] and engines.calls == [] and set(beats) == {"running"}
