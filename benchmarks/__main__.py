"""`make bench`: every benchmarks/bench_*.py, one after the other.

Or only those named: ``python -m benchmarks preprocess upload`` (``make bench BENCH=upload``)."""

import importlib
import sys
from pathlib import Path

names = sys.argv[1:] or sorted(p.stem[len("bench_") :] for p in Path(__file__).parent.glob("bench_*.py"))
sys.argv = sys.argv[:1]  # each benchmark reads its own settings from the environment
for name in names:
    print(f"\n=== bench_{name} ===", flush=True)
    importlib.import_module(f"benchmarks.bench_{name}").main()
