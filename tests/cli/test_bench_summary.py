"""The bench's figures from samples, without a server."""

from llmgw_cli.bench import BenchConfig, Sample, summarize

CONFIG = BenchConfig(base_url="http://x/v1", key="k", model="m", concurrency=2, requests=4)


def test_summary_counts_only_successes_in_rates_and_keeps_errors() -> None:
    samples = [
        Sample(True, 0.2, ttft_s=0.05, gaps_s=[0.01, 0.03], output_tokens=3),
        Sample(True, 0.4, ttft_s=0.15, gaps_s=[0.02], output_tokens=2),
        Sample(False, 0.01, error="HTTP 429: quota"),
        Sample(False, 0.01, error="HTTP 429: quota"),
    ]
    result = summarize(CONFIG, samples, elapsed_s=2.0)
    assert (result.requests, result.errors) == (4, 2)
    assert result.requests_per_s == 1.0 and result.output_tokens_per_s == 2.5
    assert result.ttft_p50_ms is not None and abs(result.ttft_p50_ms - 100.0) < 1e-6
    assert result.itl_p50_ms is not None and abs(result.itl_p50_ms - 20.0) < 1e-6
    assert result.first_errors == ["HTTP 429: quota"]


def test_no_success_means_no_percentiles() -> None:
    result = summarize(CONFIG, [Sample(False, 0.1, error="boom")], elapsed_s=1.0)
    assert result.ttft_p50_ms is None and result.latency_p99_ms is None
    assert result.requests_per_s == 0.0
