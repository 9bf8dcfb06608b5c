"""``python -m tests.chaos``: the randomized fault run (see the package)."""

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from llmgw_cli.dev.tinymodel import generate_tiny_model
from tests.chaos.run import fault_run
from tests.cluster.scenario import cluster_up
from tests.cluster.sweep import sweep
from tests.cluster.system import usable


def main(argv: list[str]) -> int:
    """Run, print the report, exit 1 on a violation (2: cannot run here)."""
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--every", type=float, default=45.0, help="seconds between faults")
    parser.add_argument("--rate", type=float, default=3.0, help="requests a second")
    parser.add_argument("--report", type=Path, help="also write the report here, as JSON")
    args = parser.parse_args(argv)
    reason = usable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    sweep()
    with tempfile.TemporaryDirectory(prefix="llmgw-chaos-") as scratch:
        root = Path(scratch)
        logs = root / "logs"
        logs.mkdir()
        tiny = generate_tiny_model(root / "model")
        with cluster_up(tiny, logs) as cluster:
            report = asyncio.run(fault_run(cluster, args.minutes, args.seed, args.every, args.rate))
        print(report.text())
        if args.report:
            args.report.write_text(report.json())
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
