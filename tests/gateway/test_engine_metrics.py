"""Relabelling engines' Prometheus text for the admin API."""

from router.api.engine_metrics import relabel

TEXT = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 42
vllm:num_requests_running{model_name="base"} 1.0 1700000000
garbage line
"""


def test_samples_gain_the_replica_labels_and_meta_lines_come_once() -> None:
    seen: set[str] = set()
    first = relabel(TEXT, {"replica": "r1", "model": "m"}, seen)
    second = relabel(TEXT, {"replica": 'r"2', "model": "m"}, seen)
    assert first == [
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
        "# TYPE llamacpp:prompt_tokens_total counter",
        'llamacpp:prompt_tokens_total{replica="r1",model="m"} 42',
        'vllm:num_requests_running{model_name="base",replica="r1",model="m"} 1.0 1700000000',
    ]
    assert second == [
        'llamacpp:prompt_tokens_total{replica="r\\"2",model="m"} 42',
        'vllm:num_requests_running{model_name="base",replica="r\\"2",model="m"} 1.0 1700000000',
    ]
