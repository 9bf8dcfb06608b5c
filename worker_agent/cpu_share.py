"""How a node's CPUs and memory are shared by the CPU engines on it (pure functions).

vLLM's CPU backend pins its OpenMP threads, by default to core 0: two engines
on one node would then compute on the same core while the others idle. So the
agent gives each CPU engine its own cores (``VLLM_CPU_OMP_THREADS_BIND``),
taken from the cores this agent may use and not held by another engine, and
its own KV-cache size (without one, vLLM reserves 92% of NUMA node 0).
"""

from collections.abc import Iterable, Sequence

NOBIND = "nobind"
MIB = 2**20
# The KV cache gets this share of the node's memory, split among the CPU
# replicas the node accepts; the rest is weights, activations and the OS.
KV_MEMORY_SHARE = 0.25
KV_MIN_BYTES = 64 * MIB


def format_cpu_list(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: the form vLLM (and taskset) read."""
    out: list[str] = []
    run: list[int] = []
    for core in sorted(set(cores)):
        if run and core != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(core)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def parse_cpu_list(text: str) -> set[int]:
    """The cores of a bind string (``"0-2,5|6"``); ``nobind``/``auto``/junk give none."""
    cores: set[int] = set()
    for part in text.replace("|", ",").split(","):
        first, dash, last = part.strip().partition("-")
        if first.isdigit() and (not dash or last.isdigit()):
            cores.update(range(int(first), int(last if dash else first) + 1))
    return cores


def choose_binding(
    available: Sequence[int], taken: Iterable[int], per_rank: int, ranks: int = 1
) -> str:
    """A bind string giving each of ``ranks`` (vLLM's TP ranks) ``per_rank`` free cores.

    ``nobind`` when not enough cores are free: unbound threads share cores the
    way any processes do, which is better than pinning onto another engine's.
    """
    held = set(taken)
    free = [c for c in sorted(set(available)) if c not in held]
    per_rank = max(1, per_rank)
    if len(free) < per_rank * ranks:
        return NOBIND
    groups = [free[i * per_rank : (i + 1) * per_rank] for i in range(ranks)]
    return "|".join(format_cpu_list(g) for g in groups)


def cores_per_engine(n_cores: int, max_cpu_replicas: int, threads: int = 0) -> int:
    """``threads`` when set, else an equal share of the cores among the CPU replicas."""
    if threads > 0:
        return threads
    return max(1, n_cores // max(1, max_cpu_replicas))


def kv_cache_bytes(memory_mib: int, max_cpu_replicas: int, configured_mib: int = 0) -> int:
    """The KV cache of one CPU engine: the configured size, else a share of the node's memory."""
    if configured_mib > 0:
        return configured_mib * MIB
    share = int(memory_mib * MIB * KV_MEMORY_SHARE) // max(1, max_cpu_replicas)
    return max(KV_MIN_BYTES, share // MIB * MIB)
