"""Runs of the CPU trainer and the ``train-local`` step on the tiny model: a gsm8k-style parquet in verl's schema, a
reward that varies within a group, the composed config, the step's CLI arguments, and the module fixture ``assets``
(registered for every test module by ``pytest_plugins`` in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
PY = sys.executable

VARIED_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    # differs between samples of one prompt, so GRPO advantages are not zero\n"
    "    return float(len(set(solution_str)) % 3)\n"
)


def write_gsm8k_parquet(path: Path, n: int = 8) -> Path:
    """gsm8k-style rows in verl's schema (what the preprocess step writes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i in range(n):
        a, b = i + 2, 3 * i + 1
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {
                        "role": "user",
                        "content": f"What is {a} + {b}? Let's think step by step and output the final answer "
                        'after "####".',
                    }
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i, "answer": f"{a} + {b} = {a + b} #### {a + b}"},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model):  # tiny_model: the session fixture in model_fixtures.py
    d = tmp_path_factory.mktemp("assets")
    model = tiny_model
    train = write_gsm8k_parquet(d / "train.parquet")
    varied = d / "varied_reward.py"
    varied.write_text(VARIED_REWARD)
    return {"model": model, "train": train, "varied": varied, "dir": d}


def compose(assets, out: Path, overrides: list[str]):
    from pipeline_steps.steps import train_local
    from pipeline_steps.training import experiment

    derived = train_local.derived_keys([assets["train"]], [], assets["model"], out)
    return experiment.compose(experiment.load("local_tiny", overrides, derived=derived))


def run_cli(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "pipeline_steps", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_local_args(assets, out: Path, steps: int) -> list[str]:
    return [
        "train-local",
        "--experiment",
        "local_tiny",
        "--train-files",
        str(assets["train"]),
        "--val-files",
        str(assets["train"]),
        "--model-path",
        str(assets["model"]),
        "--output-dir",
        str(out),
        "--override",
        f"trainer.total_training_steps={steps}",
        "--override",
        "trainer.save_freq=1",
        "--override",
        # validation before training and on resume: tests/unit/pipeline_steps/local/test_trainer_parity.py
        "trainer.val_before_train=false",
        "--override",
        f"reward.custom_reward_function.path={assets['varied']}",
        "--override",
        "reward.custom_reward_function.name=compute_score",
    ]


REQUIRED_METRICS = (
    "critic/score/mean",
    "actor/entropy",
    "response_length/mean",
    "perf/throughput",
    "timing_s/step",
    "actor/pg_loss",
)
