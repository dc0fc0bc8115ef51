"""Preprocess at DAPO-Math-17k scale: 17,917 unique rows in verl's schema, each repeated 100 times (1.79M rows).

Ours (`python -m pipeline_steps preprocess`, streamed and vectorised, with dedupe) against a baseline written the
way verl's example scripts work (`datasets.load_dataset` + `Dataset.map` with a per-row Python function, then
`to_parquet`). Each case runs in its own child process; wall time and the child's peak RSS are reported side by side.
Env: BENCH_DAPO_UNIQUE (default 17917), BENCH_DAPO_REPEAT (default 100).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

UNIQUE = int(os.environ.get("BENCH_DAPO_UNIQUE", "17917"))
REPEAT = int(os.environ.get("BENCH_DAPO_REPEAT", "100"))
TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form Answer: "
    "$Answer (without quotes) where $Answer is the answer to the problem.\n\n{p}\n\nRemember to put your answer on its "
    "own "
    'line after "Answer:".'
)

BASELINE = r"""
import sys, datasets
src, out = sys.argv[1], sys.argv[2]
ds = datasets.load_dataset("parquet", data_files=src, split="train")
def process_fn(example, idx):  # verl examples/data_preprocess style: one Python call per row
    return {"data_source": "math_dapo", "prompt": example["prompt"], "ability": example["ability"],
            "reward_model": {"style": "rule-lean", "ground_truth": example["reward_model"]["ground_truth"]},
            "extra_info": {"split": "train", "index": example["extra_info"]["index"]}}
ds = ds.map(process_fn, with_indices=True, remove_columns=ds.column_names)
ds.to_parquet(out)
"""


def generate(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i in range(UNIQUE):
        a, b = 3 + i % 97, 7 + i % 89
        problem = (
            f"Let $f(x) = {a}x^2 + {b}x + {i}$. Problem {i}: "
            f"find the sum of the roots of $f(x) = 0$ multiplied by ${a * b}$."
        )
        rows.append(
            {
                "data_source": "math_dapo",
                "prompt": [{"content": TEMPLATE.format(p=problem), "role": "user"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(-b * b), "style": "rule-lean"},
                "extra_info": {"index": f"{i:08x}-dapo"},
            }
        )
    block = pa.Table.from_pylist(rows)
    with pq.ParquetWriter(path, block.schema) as w:
        for _ in range(REPEAT):
            w.write_table(block, row_group_size=65536)


def run_child(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one child process, measured by a fresh wrapper process."""
    wrapper = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); rc = subprocess.call(sys.argv[1:], "
        "stdout=subprocess.DEVNULL); "
        "print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", wrapper, *argv],
        capture_output=True,
        text=True,
    )
    rc, wall, rss = out.stdout.strip().splitlines()[-1].split()
    if rc != "0":
        raise SystemExit(f"benchmark case failed: {' '.join(argv)}\n{out.stderr[-2000:]}")
    return float(wall), float(rss)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        tmp = Path(tmp)
        src_dir = tmp / "snapshot" / "data"
        src_dir.mkdir(parents=True)
        src = src_dir / "dapo-math-17k.parquet"
        t = time.perf_counter()
        generate(src)
        print(
            f"generated {UNIQUE * REPEAT:,} rows ({src.stat().st_size / 2**20:.0f} MiB parquet) in "
            f"{time.perf_counter() - t:.1f}s",
            flush=True,
        )
        ours = run_child(
            [
                sys.executable,
                "-m",
                "pipeline_steps",
                "preprocess",
                "--dataset",
                "dapo_math",
                "--input",
                str(tmp / "snapshot"),
                "--output",
                str(tmp / "ours"),
            ]
        )
        stats = json.loads((tmp / "ours" / "stats.json").read_text())
        script = tmp / "baseline.py"
        script.write_text(BASELINE)
        base = run_child([sys.executable, str(script), str(src), str(tmp / "baseline.parquet")])
    print(f"\n{'case':40s} {'wall s':>9s} {'peak RSS MiB':>13s}")
    print(f"{'ours (stream + vectorised + dedupe)':40s} {ours[0]:9.1f} {ours[1]:13.0f}")
    print(f"{'baseline (datasets.map per row)':40s} {base[0]:9.1f} {base[1]:13.0f}")
    print(f"speed-up {base[0] / ours[0]:.1f}x (target >= 5x); ours peak RSS {ours[1] / 1024:.2f} GiB (target < 2 GiB)")
    print(f"ours: rows in {stats['rows_in']:,}, out {stats['rows_out']:,}, duplicates {stats['duplicates']:,}")


if __name__ == "__main__":
    main()
