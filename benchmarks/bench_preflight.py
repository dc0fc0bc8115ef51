"""Pre-flight time, side by side with its floor.

Cold (a fresh process, as the train task runs it):
  baseline  ``python3 -c "import verl"``: the import alone, which no pre-flight can avoid
  preflight ``python -m pipeline_steps preflight --experiment NAME --skip-store-check`` (compose + validate + checks)
Warm (in one process, verl already imported): pre-flight of every preset.
Target: cold pre-flight under 15 s on this machine, so a bad config fails before a cluster is requested.

    .venv/bin/python -m benchmarks.bench_preflight [--repeat N]   (or: make bench BENCH=preflight)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["local_tiny", "gsm8k_qwen2_5_3b", "dapo_qwen3_4b", "gsm8k_qwen2_5_32b", "gspo"]
TARGET_S = 15.0


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--experiment", default="local_tiny")
    args = ap.parse_args(argv)

    base, pre = [], []
    for _ in range(args.repeat):  # interleaved, so machine load hits both alike
        base.append(_timed([sys.executable, "-c", "import verl"]))
        pre.append(
            _timed(
                [
                    sys.executable,
                    "-m",
                    "pipeline_steps",
                    "preflight",
                    "--experiment",
                    args.experiment,
                    "--skip-store-check",
                ]
            )
        )
    b, p = statistics.median(base), statistics.median(pre)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"pre-flight, cold process, median of {args.repeat} (load average {load:.1f} on {os.cpu_count()} cores)")
    print(f"  {'baseline: import verl':40s} {b:7.2f} s   1.00x")
    print(
        f"  {'preflight ' + args.experiment:40s} {p:7.2f} s   {p / b:.2f}x   target < {TARGET_S:.0f} s: "
        f"{'met' if p < TARGET_S else 'MISSED'}"
    )

    import verl  # noqa: F401  (warm: the import is paid once per worker process)

    from pipeline_steps.training import experiment
    from pipeline_steps.training import preflight_checks as preflight

    print("pre-flight, warm process (verl imported), per preset")
    for name in PRESETS:
        t0 = time.perf_counter()
        preflight.preflight(experiment.load(name), check_store=False)
        dt = time.perf_counter() - t0
        print(f"  {name:40s} {dt:7.2f} s   {dt / b:.2f}x of the import")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
