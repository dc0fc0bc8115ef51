"""Seconds per GRPO step of the local backend on the tiny model, against a baseline.

Full step: rollout (transformers generate) + rewards (verl's gsm8k scorer) + old
log-probs + advantages + policy-loss update (verl core_algos) on the ``local_tiny``
preset's shapes (2 prompts x rollout.n 4, 16 response tokens).
Baseline: the same step with the verl-core-algos part removed, i.e. generation and
scoring only. Both run in this process on the same trainer, after one warm-up step.

Run: ``make bench BENCH=train_step`` (or ``.venv/bin/python -m benchmarks.bench_train_step --steps 5``)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _parquet(path: Path, n: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "user", "content": f'What is {i + 2} + {3 * i + 1}? Output the final answer after "####".'}
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(4 * i + 3)},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--override", action="append", default=[], help="verl override for the local_tiny preset")
    args = ap.parse_args(argv)

    from pipeline_steps.local import grpo_cpu, tiny_model
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as tmp:
        tmp = Path(tmp)
        model = tiny_model.build(tmp / "tiny")
        train = _parquet(tmp / "train.parquet")
        derived = train_local.derived_keys([train], [], model, tmp / "run")
        cfg = experiment.compose(
            experiment.load("local_tiny", ["trainer.total_training_steps=1000", *args.override], derived=derived)
        )
        with grpo_cpu.process_group():
            trainer = grpo_cpu.GRPOTrainer(cfg, metrics_path=tmp / "metrics.jsonl")
            trainer.train_step(1)  # warm-up (first-call allocations)
            base, full = [], []
            for i in range(args.steps):  # interleaved so machine-load drift hits both alike
                t = time.perf_counter()
                trainer.generate_and_score(2 + i)
                base.append(time.perf_counter() - t)
                t = time.perf_counter()
                trainer.train_step(2 + i)
                full.append(time.perf_counter() - t)
    b, f = statistics.median(base), statistics.median(full)
    ro = cfg.actor_rollout_ref.rollout
    shape = f"{cfg.data.train_batch_size} prompts x n={ro.n}, {ro.response_length} tokens"
    print(f"GRPO step on the tiny model ({shape}), median of {args.steps}:")
    print(f"  {'variant':44s} {'s/step':>8s} {'ratio':>7s}")
    print(f"  {'baseline: generation + scoring only':44s} {b:8.3f} {1.0:7.2f}")
    print(f"  {'full GRPO step (+ verl core_algos update)':44s} {f:8.3f} {f / b:7.2f}")
    result = {
        "bench": "train_step",
        "baseline_s_per_step": b,
        "grpo_s_per_step": f,
        "ratio": f / b,
        "steps": args.steps,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
