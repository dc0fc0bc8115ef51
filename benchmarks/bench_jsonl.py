"""Preprocess a large custom JSONL (the hosted-RL shape ``{"messages": [...], "rollout_extra": {...}}``).

Ours (`python -m pipeline_steps preprocess --dataset jsonl`: lines streamed in small batches, dedupe on 16-byte
digests, rows spilled to part files) against a baseline written the way verl's example scripts work
(`datasets.load_dataset("json")` + `Dataset.map` with a per-row Python function, then `to_parquet`). Each case runs
in its own child process; wall time and the child's peak RSS are reported side by side, and ours is also run on a
quarter of the input so the growth of memory with input size shows.
Env: BENCH_JSONL_MB (default 300): the input's size; 5% of the lines repeat an earlier one, 1% are malformed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_preprocess import run_child

SIZE_MB = float(os.environ.get("BENCH_JSONL_MB", "300"))

BASELINE = r"""
import json, sys, datasets
src, out = sys.argv[1], sys.argv[2]
ds = datasets.load_dataset("json", data_files=src, split="train")
def process_fn(example, idx):  # verl examples/data_preprocess style: one Python call per row
    return {"data_source": "math_dapo", "prompt": [m for m in example["messages"] if m["role"] != "assistant"],
            "ability": "custom",
            "reward_model": {"style": "rule", "ground_truth": str(example["rollout_extra"]["solution"])},
            "extra_info": {"split": "train", "index": idx, "rollout_extra": example["rollout_extra"]}}
ds = ds.map(process_fn, with_indices=True, remove_columns=ds.column_names)
ds.to_parquet(out)
"""


def generate(path: Path, size_mb: float, malformed: bool = True) -> int:
    """Deterministic lines until the file reaches ``size_mb``; returns the line count."""
    target, n = int(size_mb * 2**20), 0
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < target:
            i = n if n % 20 else n // 2  # every 20th line repeats an earlier one
            if malformed and n % 100 == 99:
                f.write('{"messages": [{"role": "user"}\n')  # truncated line: a counted rejection
            else:
                problem = f"Problem {i}: compute {i} * {i % 97 + 3} + {i % 89}. " + "Show your work. " * 40
                row = {
                    "messages": [
                        {"role": "system", "content": "You are a careful mathematician."},
                        {"role": "user", "content": problem},
                        {"role": "assistant", "content": f"The answer is {i * (i % 97 + 3) + i % 89}."},
                    ],
                    "rollout_extra": {"solution": str(i * (i % 97 + 3) + i % 89), "source": "bench", "id": i},
                }
                f.write(json.dumps(row) + "\n")
            n += 1
    return n


def ours(src: Path, out: Path) -> tuple[float, float]:
    return run_child(
        [sys.executable, "-m", "pipeline_steps", "preprocess", "--dataset", "jsonl", "--input", str(src)]
        + ["--output", str(out), "--max-rejected-fraction", "0.05"]
    )


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-jsonl-") as tmp:
        tmp = Path(tmp)
        small, big = tmp / "small" / "rows.jsonl", tmp / "big" / "rows.jsonl"
        small.parent.mkdir()
        big.parent.mkdir()
        t = time.perf_counter()
        lines = generate(big, SIZE_MB)
        generate(small, SIZE_MB / 4)
        print(f"generated {lines:,} lines ({big.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f}s")
        quarter = ours(small, tmp / "out-small")
        full = ours(big, tmp / "out-big")
        stats = json.loads((tmp / "out-big" / "stats.json").read_text())
        script = tmp / "baseline.py"
        script.write_text(BASELINE)
        clean = tmp / "clean" / "rows.jsonl"  # the baseline cannot skip malformed lines: it gets a clean copy
        clean.parent.mkdir()
        generate(clean, SIZE_MB, malformed=False)
        base = run_child([sys.executable, str(script), str(clean), str(tmp / "baseline.parquet")])
    print(f"\n{'case':46s} {'wall s':>9s} {'peak RSS MiB':>13s}")
    print(f"{f'ours, {SIZE_MB / 4:.0f} MiB input':46s} {quarter[0]:9.1f} {quarter[1]:13.0f}")
    print(f"{f'ours, {SIZE_MB:.0f} MiB input':46s} {full[0]:9.1f} {full[1]:13.0f}")
    print(f"{f'baseline (datasets.map per row), {SIZE_MB:.0f} MiB':46s} {base[0]:9.1f} {base[1]:13.0f}")
    print(
        f"ours peak RSS {full[1]:.0f} MiB (target < 500 MiB for 300 MiB); 4x the input adds "
        f"{full[1] - quarter[1]:.0f} MiB; baseline/ours wall {base[0] / full[0]:.1f}x, RSS {base[1] / full[1]:.1f}x"
    )
    print(
        f"ours: rows in {stats['rows_in']:,}, out {stats['rows_out']:,}, duplicates {stats['duplicates']:,}, "
        f"rejected {stats['rejected']:,}"
    )


if __name__ == "__main__":
    main()
