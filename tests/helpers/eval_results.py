"""Evaluation results as evaluate records them (the promotion gate's and export's inputs), the base model's results,
and an export's lineage."""

from __future__ import annotations


def answers(avg):
    """evaluate's answer figures for a model with many distinct answers on a set whose best constant scores 10%."""
    return {
        "modal_ground_truth": "7",
        "ground_truth_distinct": 10,
        "ground_truth_top_share": 0.1,
        "best_constant": 0.1,
        "non_modal_problems": 90,
        "non_modal_avg@k": avg,
        "majority_distinct": 9,
        "majority_top": "3",
        "majority_top_share": 0.15,
    }


def results(avg, k=4, eval_sha="e" * 64, temperature=1.0):
    return {
        "overall": {
            "avg@k": avg,
            "k": k,
            "problems": 3,
            "samples_scored": 3 * k,
            "maj@k": avg,
            "pass@k": {str(k): avg},
            "answers": answers(avg),  # what evaluate records: a varied model, a low prior
        },
        "eval_set": {"sha256": eval_sha, "name": "aime"},
        "sampling": {"k": k, "temperature": temperature, "top_p": 1.0, "max_new_tokens": 8, "max_problems": 0},
        "model": {"content_sha256": "m" * 64},
    }


BASE = results(0.25)


def export_results(avg, eval_sha="e" * 64):
    return {
        "overall": {
            "avg@k": avg,
            "k": 2,
            "problems": 2,
            "samples_scored": 4,
            "maj@k": avg,
            "pass@k": {"1": avg, "2": avg},
            "answers": answers(avg),  # what evaluate records: a varied model, a low prior
        },
        "eval_set": {"sha256": eval_sha, "name": "aime2024", "rows": 2},
        "sampling": {"k": 2, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "max_problems": 0},
        "model": {},
        "scorer": "verl.utils.reward_score.default_compute_score",
    }


LINEAGE = {
    "base_model": {"name": "local/tiny", "revision": "rev-0a1b2c"},
    "datasets": [
        {
            "name": "gsm8k",
            "role": "train",
            "repo_id": "openai/gsm8k",
            "revision": "e53f048",
            "content_hash": "c0ffee" * 4,
        },
        {
            "name": "aime2024",
            "role": "eval",
            "repo_id": "Maxwell-Jia/AIME_2024",
            "revision": "v1",
            "content_hash": "beef" * 6,
        },
    ],
    "experiment": {
        "name": "local_tiny",
        "preset_sha256": "ab" * 32,
        "overrides": ["trainer.total_training_steps=3"],
        "overrides_sha256": "cd" * 32,
    },
    "verl_version": "0.9.1",
    "dag_id": "verl_grpo_pipeline",
    "run_id": "manual__2026-11-22T03:00:00+00:00",
}
