"""Issue 46 item 2: a run whose memory cannot fit its backend is refused by pre-flight in one line naming the setting,
before any CPU or GPU is committed; an allocation that still fails in the CPU trainer is bad input (exit 2, not
"unexpected error", so not retried) naming the setting.

Before: ``actor_rollout_ref.rollout.response_length=10^9`` on the local backend passed plan and pre-flight, and
``train-local`` asked for a 64 GB tensor (the padding ``torch.full`` of its generation), exiting 1 as "unexpected
error", so Airflow ran it three times.
"""

from __future__ import annotations

import json

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.training import experiment
from pipeline_steps.training import preflight_checks as preflight
from tests.helpers.step_cli import assert_refused, run_step

HUGE = "actor_rollout_ref.rollout.response_length=1000000000"


def refusal(name: str, overrides=(), derived=None, backend: str | None = None) -> str:
    exp = experiment.load(name, list(overrides), derived=derived)
    if backend:
        exp.spec["backend"] = backend
    with pytest.raises(UserError) as err:
        preflight.preflight(exp, check_store=False)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_machine_memory_is_this_machines():
    total, where = preflight.machine_memory()
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
    assert 0 < total <= int(meminfo["MemTotal"].split()[0]) * 1024 and where


def test_a_response_length_of_a_billion_is_refused_on_the_local_backend():
    message = refusal("local_tiny", [HUGE])
    assert message.startswith("memory: data.train_batch_size x actor_rollout_ref.rollout.n x "), message
    assert "= 2 x 4 x (256 + 1000000000) = 8,000,002,048 tokens" in message
    assert "more than this machine's" in message and message.endswith("lower actor_rollout_ref.rollout.response_length")


def test_a_batch_too_large_for_the_presets_gpus_is_refused_naming_the_batch():
    message = refusal("gsm8k_qwen2_5_3b", ["data.train_batch_size=65536", "actor_rollout_ref.rollout.n=1024"])
    assert "more than the 8 GPUs' 640 GB (80 GB each: the default per GPU)" in message, message
    assert message.endswith("lower data.train_batch_size or actor_rollout_ref.rollout.n"), message


def test_a_model_too_large_for_the_gpus_is_refused(tmp_path, monkeypatch):
    """A deployment's preset states its GPUs' memory (cluster.gpu_memory_gb); the model's size comes from its name
    (the staged path names the model the run trains, the form's or the preset's)."""
    presets = tmp_path / "presets"
    presets.mkdir()
    text = experiment.resolve_path("gsm8k_qwen2_5_32b").read_text().replace("name: gsm8k_qwen2_5_32b", "name: small")
    (presets / "small.yaml").write_text(text.replace("cluster:\n", "cluster:\n  gpu_memory_gb: 24\n", 1))
    monkeypatch.setenv("PIPELINE_PRESETS_DIR", str(presets))
    staged = {"actor_rollout_ref.model.path": "oss://verl-store/verl/models/Qwen/Qwen2.5-72B-Instruct/main"}
    message = refusal("small", derived=staged)
    assert "a 72B-parameter model need at least" in message, message
    assert "(24 GB each: cluster.gpu_memory_gb)" in message
    assert message.endswith("choose a smaller model, or more GPUs (trainer.nnodes, trainer.n_gpus_per_node)")


def test_the_model_on_this_machine_is_sized_from_its_config(tmp_path, monkeypatch):
    model = tmp_path / "models" / "org" / "m" / "main"
    model.mkdir(parents=True)
    config = {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 36, "intermediate_size": 11008}
    (model / "config.json").write_text(json.dumps(config))
    exp = experiment.load("local_tiny", derived={"actor_rollout_ref.model.path": str(model)})
    monkeypatch.setattr(preflight, "machine_memory", lambda: (1024 * preflight.GB, "a test's 1 TB"))
    summary = preflight.preflight(exp, check_store=False)["memory"]
    assert 3.5e9 < summary["model_parameters"] < 3.8e9 and summary["model_size_from"].endswith("config.json")
    monkeypatch.setattr(preflight, "machine_memory", lambda: (8 * preflight.GB, "a test's 8 GB"))
    message = refusal("local_tiny", derived={"actor_rollout_ref.model.path": str(model)})
    assert "a 3.66B-parameter model need at least 56.7 GB, more than this machine's 8.0 GB (a test's 8 GB)" in message
    assert message.endswith("choose a smaller model, or the kuberay backend"), message


@pytest.mark.slow  # verl imported and its config composed in a subprocess
def test_preflight_cli_refuses_it_in_one_line_exit_2():
    code, summary, err = run_step("preflight", "--experiment", "local_tiny", "--skip-store-check", f"--override={HUGE}")
    assert_refused(code, err, "memory:", "lower actor_rollout_ref.rollout.response_length")
    assert summary["ok"] is False


# -- an allocation that still fails in the CPU trainer ------------------------------------------------------------

TORCH_CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: not enough memory: you tried to allocate "
    "64000016384 bytes."
)


@pytest.mark.parametrize(
    "fault",
    [RuntimeError(TORCH_CPU_OOM), MemoryError(), "torch.OutOfMemoryError"],
    ids=["cpu-allocator", "MemoryError", "OutOfMemoryError"],
)
def test_a_failed_allocation_is_bad_input_naming_the_setting(fault, tmp_path):
    import torch

    from pipeline_steps.local import grpo_cpu
    from tests.helpers.train_local_runs import write_gsm8k_parquet

    if fault == "torch.OutOfMemoryError":
        fault = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 59.60 GiB")
    data = write_gsm8k_parquet(tmp_path / "train.parquet")
    cfg = experiment.compose(
        experiment.load(
            "local_tiny",
            ["actor_rollout_ref.rollout.response_length=100000"],
            derived={"data.train_files": [str(data)], "trainer.default_local_dir": str(tmp_path / "ckpt")},
        )
    )
    error = grpo_cpu.out_of_memory(cfg, fault)
    assert isinstance(error, UserError) and "\n" not in str(error)
    assert str(error).startswith("out of memory in the CPU trainer (")
    assert "= 2 x 4 x (256 + 100000) tokens per step; lower actor_rollout_ref.rollout.response_length" in str(error)
    assert grpo_cpu.out_of_memory(cfg, RuntimeError("shape mismatch")) is None  # any other fault stays unexpected


@pytest.mark.slow  # the CPU trainer built on the tiny model, in process
def test_train_local_exits_2_in_one_line_when_an_allocation_fails(assets, tmp_path, capsys, monkeypatch):
    """The real ``train-local`` step, its generation's allocation failing as torch's CPU allocator fails it: exit 2 (bad
    input: the train task is not retried), one line naming the setting; before, exit 1 "unexpected error"."""
    from pipeline_steps import cli
    from pipeline_steps.local import grpo_cpu

    def allocation_fails(self, *args, **kwargs):
        raise RuntimeError(TORCH_CPU_OOM)

    monkeypatch.setattr(grpo_cpu.GRPOTrainer, "generate", allocation_fails)
    code = cli.main(
        [
            "train-local",
            "--experiment",
            "local_tiny",
            "--train-files",
            str(assets["train"]),
            "--model-path",
            str(assets["model"]),
            "--output-dir",
            str(tmp_path / "o"),
        ]
    )
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith(("error", "unexpected"))]
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: out of memory in the CPU trainer"), err
    assert "lower actor_rollout_ref.rollout.response_length" in err[0]
