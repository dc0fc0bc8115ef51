"""The CPU GRPO trainer and the ``train-local`` step, for real: tiny Qwen2 model, verl's
config composition, verl's core_algos / reward scoring / checkpoint manager / model merger.

Nothing is mocked. The data is a small gsm8k-style parquet in verl's schema built here
with pyarrow. Rewards are injected through the two documented seams: the trainer's
``reward_fn`` argument and verl's own ``reward.custom_reward_function.{path,name}``
config keys. In the equal-reward test ``optim.weight_decay`` is 0: AdamW's decoupled
decay would otherwise shrink every weight regardless of the (exactly zero) policy
gradient, which a companion assertion shows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.train_local_runs import REQUIRED_METRICS, compose, run_cli, train_local_args

ROOT = Path(__file__).resolve().parents[4]
PY = sys.executable


def initial_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def checkpoint_weights(actor_dir: Path) -> dict:
    import torch

    sd = torch.load(actor_dir / "model_world_size_1_rank_0.pt", map_location="cpu", weights_only=False)
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in sd.items()}


def diff_keys(a: dict, b: dict) -> list[str]:
    import torch

    common = sorted(set(a) & set(b))
    assert len(common) >= len(a) - 1, f"checkpoint and model share too few tensors: {set(a) ^ set(b)}"
    return [k for k in common if not torch.equal(a[k].float(), b[k].float())]


# ----------------------------------------------------------------------------- learning signal


def _varied(data_source, solution_str, ground_truth, extra_info=None):  # the reward_fn seam
    """Differs within a group, so GRPO's advantages (and the update) are not zero."""
    return float(len(set(solution_str)) % 3)


def test_parameters_change_when_rewards_differ_within_a_group(assets, tmp_path, monkeypatch):
    import tempfile

    from pipeline_steps.local import grpo_cpu

    shared_tmp = tmp_path / "tmp"  # the process's temporary directory (/tmp), where verl takes its checkpoint locks
    shared_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    out = tmp_path / "run"
    cfg = compose(assets, out, ["trainer.total_training_steps=1", "actor_rollout_ref.actor.optim.weight_decay=0.0"])

    summary = grpo_cpu.train(cfg, reward_fn=_varied, metrics_path=out / "metrics.jsonl")
    m = summary["final_metrics"]
    assert m["critic/score/max"] > m["critic/score/min"], "the reward must differ between samples for this test"
    assert m["critic/advantages/max"] > 0 > m["critic/advantages/min"]
    assert m["actor/grad_norm"] > 0
    changed = diff_keys(initial_weights(assets["model"]), checkpoint_weights(out / "checkpoints/global_step_1/actor"))
    assert len(changed) > 5, changed
    # the save left nothing behind: no verl lock file in the temporary directory, none in the checkpoint
    assert not list(shared_tmp.iterdir()) and not list(out.glob("checkpoints/**/*.lock")), list(shared_tmp.iterdir())


def test_parameters_stay_exactly_equal_when_all_rewards_equal(assets, tmp_path):
    from pipeline_steps.local import grpo_cpu

    out = tmp_path / "run"
    cfg = compose(assets, out, ["trainer.total_training_steps=2", "actor_rollout_ref.actor.optim.weight_decay=0.0"])
    summary = grpo_cpu.train(cfg, reward_fn=lambda **kw: 1.0, metrics_path=out / "metrics.jsonl")
    lines = grpo_cpu.read_metrics(out / "metrics.jsonl")
    assert [x["step"] for x in lines] == [1, 2]
    for x in lines:
        d = x["data"]
        assert d["critic/score/mean"] == 1.0
        assert d["critic/advantages/max"] == 0.0 and d["critic/advantages/min"] == 0.0
        assert d["actor/grad_norm"] == 0.0
    assert summary["last_step"] == 2
    assert (
        diff_keys(initial_weights(assets["model"]), checkpoint_weights(out / "checkpoints/global_step_2/actor")) == []
    )

    # The same run with verl's default weight decay (0.01) does move them: that is why it is 0 above.
    out2 = tmp_path / "run_wd"
    cfg2 = compose(assets, out2, ["trainer.total_training_steps=1"])
    assert float(cfg2.actor_rollout_ref.actor.optim.weight_decay) > 0
    grpo_cpu.train(cfg2, reward_fn=lambda **kw: 1.0, metrics_path=out2 / "metrics.jsonl")
    assert diff_keys(initial_weights(assets["model"]), checkpoint_weights(out2 / "checkpoints/global_step_1/actor"))


# ----------------------------------------------------------------------------- CLI, layout, resume


def _comparable(lines):
    return [(x["step"], {k: v for k, v in x["data"].items() if not k.startswith(("timing", "perf/"))}) for x in lines]


@pytest.mark.slow
def test_cli_layout_merger_and_resume_after_kill_equals_clean_run(assets, tmp_path):
    import torch

    from pipeline_steps.local import grpo_cpu

    steps = 3
    # keep 1, as verl counts it: the checkpoints this process saved (tested on the crashed run below)
    keep_one = ["--override", "trainer.max_actor_ckpt_to_keep=1"]
    clean = tmp_path / "clean"
    res = run_cli(*train_local_args(assets, clean, steps), *keep_one)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["last_step"] == steps and summary["resumed_from_step"] == 0
    ckpt = clean / "checkpoints"
    assert summary["checkpoint_dir"] == str(ckpt / f"global_step_{steps}")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps)
    actor = ckpt / f"global_step_{steps}" / "actor"
    for name in (
        "model_world_size_1_rank_0.pt",
        "optim_world_size_1_rank_0.pt",
        "extra_state_world_size_1_rank_0.pt",
        "fsdp_config.json",
        "huggingface/config.json",
        "huggingface/tokenizer.json",
    ):
        assert (actor / name).is_file(), name
    assert json.loads((actor / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 1}
    assert not list(ckpt.glob(".tmp-*")), "no temporary checkpoint directories may be left"
    assert sorted(p.parent.name for p in ckpt.glob("global_step_*/actor")) == [f"global_step_{steps}"]
    assert json.loads((clean / "train_summary.json").read_text())["last_step"] == steps
    lines = grpo_cpu.read_metrics(clean / "metrics.jsonl")
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    for x in lines:
        assert all(k in x["data"] for k in REQUIRED_METRICS), set(REQUIRED_METRICS) - set(x["data"])
    assert any(x["data"]["critic/advantages/max"] > 0 for x in lines), "the varied reward must give a learning signal"

    # verl's own model merger (what the export step runs) accepts the checkpoint.
    merged = tmp_path / "merged"
    res = subprocess.run(
        [
            PY,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(actor),
            "--target_dir",
            str(merged),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    from safetensors.torch import load_file

    merged_sd = load_file(str(next(merged.glob("*.safetensors"))))
    shard = checkpoint_weights(actor)
    # the merger writes bfloat16 (as it does for cluster checkpoints)
    assert merged_sd and all(torch.equal(merged_sd[k], shard[k].to(merged_sd[k].dtype)) for k in merged_sd)

    # A crash mid-run (SIGKILL once checkpoint 1 is complete), then a retry with the same arguments. The run is
    # single-stepped (SIGSTOP, look, SIGCONT for 20 ms) so that it cannot pass checkpoint 1 between two looks,
    # however loaded the machine is.
    crashed = tmp_path / "crashed"
    proc = subprocess.Popen(
        [PY, "-m", "pipeline_steps", *train_local_args(assets, crashed, steps), *keep_one],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    tracker = crashed / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            os.killpg(proc.pid, signal.SIGSTOP)
            if tracker.exists() and tracker.read_text().strip() == "1":
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    killed_at = int(tracker.read_text())
    assert killed_at == 1
    res = run_cli(*train_local_args(assets, crashed, steps), *keep_one)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == killed_at and summary["last_step"] == steps
    # verl's manager removes only what its own process saved: step 1's actor, from the killed attempt, stays
    kept = sorted(p.parent.name for p in (crashed / "checkpoints").glob("global_step_*/actor"))
    assert kept == [f"global_step_{killed_at}", f"global_step_{steps}"], kept
    # Same weights, optimiser state and per-step metrics as the uninterrupted run.
    assert (
        diff_keys(checkpoint_weights(actor), checkpoint_weights(crashed / f"checkpoints/global_step_{steps}/actor"))
        == []
    )
    assert _comparable(grpo_cpu.read_metrics(crashed / "metrics.jsonl")) == _comparable(lines)

    # Running again after the end trains nothing and reports the same result.
    res = run_cli(*train_local_args(assets, crashed, steps))
    assert res.returncode == 0, res.stderr[-2000:]
    again = json.loads(res.stdout.strip().splitlines()[-1])
    assert again["resumed_from_step"] == steps and again["last_step"] == steps
    assert again["final_metrics"] == summary["final_metrics"]


class Killed(BaseException):
    """Where a SIGKILL would stop the run (a BaseException: nothing in the trainer catches it)."""


@pytest.mark.slow  # three short runs of the tiny model, in this process
def test_a_kill_between_a_save_and_its_metrics_line_loses_no_line(assets, tmp_path, monkeypatch):
    """Killed once step 2's checkpoint is in place but before step 2's metrics line is written, the retry's history
    equals a clean run's. verl's trainer advances the tracker at the save, so a retry would resume past step 2 and its
    line would never come; the CPU trainer advances it after the line, so step 2 runs again."""
    from pipeline_steps.local import grpo_cpu

    def run(out: Path) -> dict:
        return grpo_cpu.train(compose(assets, out, []), reward_fn=_varied, metrics_path=out / "metrics.jsonl")

    clean = run(tmp_path / "clean")
    assert clean["last_step"] == 3
    tracking = grpo_cpu._tracking

    def killed_before_line_2(*args, **kwargs):
        logger, *rest = tracking(*args, **kwargs)
        log = logger.log

        def log_or_die(data, step):
            if step == 2:
                raise Killed
            return log(data=data, step=step)

        logger.log = log_or_die
        return (logger, *rest)

    crashed = tmp_path / "crashed"
    monkeypatch.setattr(grpo_cpu, "_tracking", killed_before_line_2)
    with pytest.raises(Killed):
        run(crashed)
    assert (crashed / "checkpoints/global_step_2/actor").is_dir()  # the save came before the kill
    monkeypatch.setattr(grpo_cpu, "_tracking", tracking)
    retried = run(crashed)
    assert _comparable(grpo_cpu.read_metrics(crashed / "metrics.jsonl")) == _comparable(
        grpo_cpu.read_metrics(tmp_path / "clean" / "metrics.jsonl")
    )
    assert (retried["resumed_from_step"], retried["last_step"]) == (1, 3)


# ----------------------------------------------------------------------------- bad input


def _main(capsys, *argv):
    from pipeline_steps import cli

    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_missing_train_file_is_one_line_exit_2(assets, tmp_path, capsys):
    code, err = _main(
        capsys,
        "train-local",
        "--experiment",
        "local_tiny",
        "--train-files",
        str(tmp_path / "nope.parquet"),
        "--model-path",
        str(assets["model"]),
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert code == 2 and "nope.parquet" in err and "not found" in err
    assert not (tmp_path / "o").exists()


def test_wrong_schema_names_the_column(assets, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "hi"}]}] * 4), bad
    )
    code, err = _main(
        capsys,
        "train-local",
        "--experiment",
        "local_tiny",
        "--train-files",
        str(bad),
        "--model-path",
        str(assets["model"]),
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert code == 2 and "reward_model" in err and "bad.parquet" in err
    assert not (tmp_path / "o" / "checkpoints").exists()


@pytest.mark.parametrize(
    "override,needle",
    [
        ("algorithm.adv_estimator=grpoo", "adv_estimator"),
        ("algorithm.adv_estimator=gae", "critic"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "ppo_mini_batch_size"),
        ("actor_rollout_ref.actor.optim.lrr=1e-6", "lrr"),
        ("trainer.logger=[console,mlfow]", "trainer.logger"),  # a typo in a backend name
    ],
)
def test_bad_config_is_one_line_exit_2(assets, tmp_path, capsys, override, needle):
    code, err = _main(
        capsys,
        "train-local",
        "--experiment",
        "local_tiny",
        "--train-files",
        str(assets["train"]),
        "--model-path",
        str(assets["model"]),
        "--output-dir",
        str(tmp_path / "o"),
        "--override",
        override,
    )
    assert code == 2, err
    assert err.startswith("error: ") and needle in err
