"""``wrk`` (the Debian package) as the outside client of the router benchmark.

The in-repo clients (tests/bench/fasthttp.py) are Python on the same two
cores; wrk is C with its own event loop, so what it measures is the servers'
cost, not the client's. ``ensure_wrk`` installs it where it is missing and
the benchmark may (root or passwordless sudo, apt); otherwise the benchmark
says so and keeps to its own clients.
"""

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def ensure_wrk() -> tuple[str | None, str]:
    """The wrk executable, installed with apt-get when missing; or None and why."""
    found = shutil.which("wrk")
    if found:
        return found, ""
    if os.geteuid() == 0:
        prefix: list[str] = []
    elif shutil.which("sudo"):
        prefix = ["sudo", "-n"]
    else:
        return None, "wrk is not installed and this user cannot apt-get install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [*prefix, "apt-get", "install", "-y", "-q", "wrk"]
    # Once as is; then after refreshing the package lists (a fresh image has none).
    for before in ([], [*prefix, "apt-get", "update", "-q"]):
        for args in ([before] if before else []) + [install]:
            subprocess.run(args, env=env, capture_output=True, timeout=600, check=False)
        found = shutil.which("wrk")
        if found:
            return found, ""
    return None, "apt-get install wrk failed (offline, or not a Debian-like system)"


def lua_script(raw: bytes, work: Path) -> Path:
    """A wrk script sending ``raw``'s method, headers and body (an HTTP/1.1 request)."""
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    method = lines[0].split(" ", 1)[0]
    out = [f'wrk.method = "{method}"', f"wrk.body = [[{body.decode()}]]"]
    for line in lines[1:]:
        name, value = line.split(":", 1)
        if name.lower() in ("host", "content-length"):
            continue  # wrk sets these
        out.append(f'wrk.headers["{name}"] = "{value.strip()}"')
    script = work / f"wrk-{abs(hash(raw))}.lua"
    script.write_text("\n".join(out) + "\n")
    return script


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    return float(m.group(1)) * _UNIT[m.group(2)] if m else float("nan")


def run_wrk(
    exe: str, url: str, script: Path, conns: int, threads: int, seconds: float
) -> WrkResult:
    """One wrk run; its latency percentiles and requests/s."""
    out = subprocess.run(
        [exe, f"-t{threads}", f"-c{conns}", f"-d{seconds:.0f}s", "--latency", "-s", str(script),
         url],
        capture_output=True, text=True, timeout=seconds + 60, check=True,
    ).stdout  # fmt: skip
    pcts = dict(re.findall(r"^\s+(50|99)%\s+(\S+)\s*$", out, re.M))
    total = re.search(r"(\d+) requests in", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = sum(int(n) for n in re.findall(r"(?:Non-2xx or 3xx responses|timeout):?\s+(\d+)", out))
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+)", out)
    if socket_errors:
        errors += sum(int(n) for n in socket_errors.groups())
    return WrkResult(
        rps=float(rps.group(1)) if rps else 0.0,
        p50_ms=_ms(pcts.get("50", "")),
        p99_ms=_ms(pcts.get("99", "")),
        requests=int(total.group(1)) if total else 0,
        errors=errors,
    )
