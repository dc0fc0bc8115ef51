"""Each cluster preset carries the settings of the guide it names, key for key (issue 13 item 5).

The guides are the four seeds in ``../shared/seeds/`` (not part of this repository, so not read here): the values
below are transcribed from them, in each guide's own words where it has a name for the setting (seed 003's script
variables, seed 002's Model Studio hyperparameters). What a preset deliberately does not take from its guide (the
tool agent of seeds 000 and 003, an MLflow logger, seed 000's one-step smoke run) is listed in the preset's header
comment. The vision-language presets (issue 30) follow verl's own geometry3k example script instead of a seed.
"""

from __future__ import annotations

import json

import pytest

from pipeline_steps.training import experiment

# seed 000 (Alibaba Cloud ACK, 000_4063a68973fea04e.txt): the RayJob entrypoint's overrides (line 44) and its
# gsm8k_multiturn_grpo.yaml (line 40); the pod's Lingjun toleration and resources are on line 44 too
ACK_000 = {
    "algorithm.adv_estimator": "grpo",
    "data.train_batch_size": 16,
    "data.max_prompt_length": 1024,
    "data.max_response_length": 1024,
    "data.filter_overlong_prompts": True,
    "data.truncation": "error",
    "data.return_raw_chat": True,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.mode": "async",
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.n": 16,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.ref.fsdp_config.param_offload": True,
    "actor_rollout_ref.hybrid_engine": True,
    "algorithm.use_kl_in_reward": False,
    "trainer.critic_warmup": 0,
    "trainer.project_name": "gsm8k_tool-agent",
    "trainer.experiment_name": "qwen2.5-3b_function_rm-gsm8k-vllm-tool-agent-verify-n16",
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
    # trainer.save_freq 1 goes with the guide's one-step run: a listed deviation (50;
    # tests/unit/pipeline_steps/training/test_presets_fit_cluster.py)
    "trainer.test_freq": 20,
    "actor_rollout_ref.actor.checkpoint.save_contents": ["hf_model", "model"],
    "trainer.total_epochs": 1,
}
# seed 004 (Google Cloud GKE, 004_1bd47ef7b1371c15.txt): the main_ppo arguments of the job submission (lines
# 323-348); the worker group (lines 178-273), the runtime env's NCCL settings (lines 284-303), the PV (lines 62-79)
GKE_004 = {
    "data.train_batch_size": 256,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "actor_rollout_ref.actor.optim.lr": 1e-5,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 64,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 8,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "trainer.val_before_train": False,
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 2,
    "trainer.save_freq": 10,
    "trainer.test_freq": 10,
    "algorithm.adv_estimator": "grpo",
    "actor_rollout_ref.rollout.n": 8,
    "trainer.total_epochs": 2,
}
# seed 003 (Tencent Cloud TI-ONE, 003_e9e8eb827b395e1a.txt): run_qwen3-4b-instruct_dapo_e2b_code_tool.sh with its
# variables expanded (variables lines 98-146, arguments lines 149-205); the Ray task's shape on lines 228-230
_prompt, _response = 2048, 16384
TIONE_003 = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_ctrl.kl_coef": 0.0,
    "data.return_raw_chat": True,
    "data.train_batch_size": 128,
    "data.max_prompt_length": _prompt,
    "data.max_response_length": _response,
    "data.filter_overlong_prompts": True,
    "data.truncation": "error",
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.0,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.28,
    "actor_rollout_ref.actor.clip_ratio_c": 10.0,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (_prompt + _response) * 1,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4,
    "actor_rollout_ref.actor.fsdp_config.param_offload": True,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": (_prompt + _response) * 4,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.mode": "async",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.9,
    "actor_rollout_ref.rollout.n": 8,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 0.6,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0,
    "actor_rollout_ref.rollout.val_kwargs.n": 30,
    "trainer.project_name": "e2b_code_retool",
    "trainer.experiment_name": "qwen3-4b_dapo",
    "trainer.n_gpus_per_node": 4,
    "trainer.val_before_train": True,
    "trainer.log_val_generations": 100,
    "trainer.nnodes": 1,
    "trainer.save_freq": 30,
    "trainer.test_freq": 5,
    "trainer.total_epochs": 1,
}
# seed 002 (Alibaba Cloud Model Studio, 002_a7493373bbb8ae94.txt): its 13 GSPO hyperparameters (lines 305-321),
# mapped onto verl's keys
STUDIO_002 = {
    "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",  # algorithm: gspo
    "trainer.total_epochs": 5,  # n_epochs
    "actor_rollout_ref.actor.optim.lr": 7e-6,  # learning_rate
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",  # lr_scheduler_type
    "data.train_batch_size": 128,  # batch_size
    "actor_rollout_ref.rollout.n": 8,  # n_rollouts
    "actor_rollout_ref.actor.ppo_mini_batch_size": 16,  # ppo_mini_batch_size
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,  # kl_loss_coef
    "data.max_prompt_length": 2048,  # max_prompt_length
    "data.max_response_length": 8192 - 2048,  # max_length (prompt + response)
    "trainer.test_freq": 50,  # eval_steps
    "trainer.save_freq": 100,  # save_steps (save_strategy: steps)
    "trainer.max_actor_ckpt_to_keep": 3,  # save_total_limit
}
# seed 000's tool agent: gsm8k_multiturn_grpo.yaml (line 40: multi_turn.enable, max_assistant_turns 5) and the rows'
# agent_name tool_agent (the preprocess script, line 35); the tool itself is a listed deviation
ACK_000_TOOL_AGENT = {
    **ACK_000,
    "actor_rollout_ref.rollout.multi_turn.enable": True,
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 5,
    "actor_rollout_ref.rollout.agent.default_agent_loop": "tool_agent",
}
# seed 003's tool agent: max_turns=8 (line 130) as max_user_turns and max_assistant_turns, hermes (lines 184-188),
# compute_score of the reward file (line 164)
TIONE_003_RETOOL = {
    **TIONE_003,
    "actor_rollout_ref.rollout.multi_turn.enable": True,
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": 8,
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 8,
    "actor_rollout_ref.rollout.multi_turn.format": "hermes",
    "reward.custom_reward_function.name": "compute_score",
}
# verl's vision-language GRPO example (issue 30): examples/grpo_trainer/run_qwen2_5_vl_7b_fsdp.sh at verl tag v0.9.0
# (the newest tag of the mirror; verl 0.9.1 is pinned, and main after v0.9.0 changes only the script's uv launcher),
# its GPU branch with INFER_BACKEND=vllm and the defaults of its knobs, copied from the script: DATA, MODEL, ACTOR,
# ROLLOUT, REF, TRAINER and EXTRA arrays. Left out as pipeline-derived: data.train_files/val_files ($HOME/data/geo3k/
# {train,test}.parquet) and actor_rollout_ref.model.path (MODEL_PATH). The older run_qwen2_5_vl-7b.sh named in the
# issue was folded into this script before v0.9.0 (verl PR 6126, 2026-04-30).
VERL_GEO3K_VL_7B = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "data.image_key": "images",
    "data.train_batch_size": 512,
    "data.max_prompt_length": 1024,
    "data.max_response_length": 2048,
    "data.filter_overlong_prompts": True,
    "data.truncation": "error",
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 128,
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 24576,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.kl_loss_coef": 0.01,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
    "actor_rollout_ref.rollout.n": 5,
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": True,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 24576,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": True,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 24576,
    "actor_rollout_ref.ref.fsdp_config.param_offload": True,
    "trainer.balance_batch": True,
    "trainer.project_name": "verl_grpo_geo3k",
    "trainer.experiment_name": "qwen2_5_vl_7b_vllm_fsdp",
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
    "trainer.save_freq": 20,
    "trainer.test_freq": 5,
    "trainer.total_epochs": 15,
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.model.use_fused_kernels": True,
    "actor_rollout_ref.rollout.multi_stage_wake_up": True,
    "actor_rollout_ref.rollout.enable_chunked_prefill": False,
    "actor_rollout_ref.rollout.enforce_eager": False,
    "actor_rollout_ref.rollout.free_cache_engine": True,
}
# the small preset: the same script with its MODEL_PATH (and so EXPERIMENT_NAME) knob changed, a listed deviation
VERL_GEO3K_VL_3B = {k: v for k, v in VERL_GEO3K_VL_7B.items() if k != "trainer.experiment_name"}
GUIDES = {
    "geo3k_qwen2_5_vl_7b": VERL_GEO3K_VL_7B,
    "geo3k_qwen2_5_vl_3b": VERL_GEO3K_VL_3B,
    "gsm8k_qwen2_5_3b": ACK_000,
    "gsm8k_tool_agent_qwen2_5_3b": ACK_000_TOOL_AGENT,
    "gsm8k_qwen2_5_32b": GKE_004,
    "dapo_qwen3_4b": TIONE_003,
    "dapo_retool_qwen3_4b": TIONE_003_RETOOL,
    "gspo": STUDIO_002,
}


def _value(exp, key):
    keys = {**experiment.cluster_keys(exp.spec), **exp.verl}
    return keys.get(key, "<not set>")


@pytest.mark.parametrize("preset", sorted(GUIDES))
def test_every_setting_of_the_guide_is_in_its_preset(preset):
    exp = experiment.load(preset)
    wrong = {k: (v, _value(exp, k)) for k, v in GUIDES[preset].items() if _value(exp, k) != v}
    assert not wrong, f"{preset}: guide value vs preset value: {wrong}"


def test_the_guides_cluster_shapes():
    """Worker pods sized as the guides' GPU pods, on the guides' node types, with their networking."""
    ack = experiment.load("gsm8k_qwen2_5_3b").spec["cluster"]
    assert ack["worker"]["cpu"] == "100" and ack["worker"]["memory"] == "500Gi" and ack["gpus_per_node"] == 8
    assert {"key": "node-role.alibabacloud.com/lingjun"} in ack["tolerations"]
    assert ack["security_context"] == {"runAsUser": 0}
    gke = experiment.load("gsm8k_qwen2_5_32b").spec["cluster"]
    assert gke["node_selector"] == {"cloud.google.com/gke-accelerator": "nvidia-b200"}
    assert (gke["worker"]["cpu"], gke["worker"]["memory"], gke["worker"]["shm"]) == ("220", "2800Gi", "250Gi")
    assert (gke["head"]["cpu"], gke["head"]["memory"]) == ("12", "32G")
    assert gke["env"]["NCCL_NET_PLUGIN"] == "/usr/local/gib/lib64/libnccl-net_internal.so"
    assert gke["env"]["NCCL_TUNER_CONFIG_PATH"].endswith("tuner_config_a4.txtpb")  # B200 (H200: a3u)
    assert gke["env"]["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64" and gke["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert gke["worker_host_paths"] == {
        "/usr/local/nvidia": "/home/kubernetes/bin/nvidia",
        "/usr/local/gib": "/home/kubernetes/bin/gib",
    }
    assert '"network":"rdma-7"' in gke["worker_annotations"]["networking.gke.io/interfaces"]
    tione = experiment.load("dapo_qwen3_4b").spec
    # the guide's 128C1000G head and worker fit no Kubernetes node pool here: listed deviations, sized to the pools
    # (tests/unit/pipeline_steps/training/test_presets_fit_cluster.py)
    assert {"cluster.head", "cluster.worker"} <= {d["key"] for d in tione["deviations"]}
    assert tione["datasets"] == {"train": ["dapo_math"], "val": ["aime2024"]}  # DAPO-Math-17k, AIME 2024


@pytest.mark.parametrize("preset", sorted(GUIDES))
def test_deviations_are_listed_with_the_guides_value_ours_and_why(preset):
    """A preset's ``deviations:`` list names each guide setting it does not take (key, the guide's value, ours,
    why). A listed key must not be one the preset matches (the table above), and where ``ours`` names a verl value
    the preset must hold exactly that, so the list cannot drift from the preset."""
    exp = experiment.load(preset)
    deviations = exp.spec.get("deviations")
    assert deviations, f"{preset}: no deviations list"
    for d in deviations:
        assert set(d) == {"key", "guide", "ours", "why"} and d["why"], d
        assert d["key"] not in GUIDES[preset], f"{d['key']} is in the guide table: it must match, not deviate"
        if d["key"] in exp.verl:
            assert str(exp.verl[d["key"]]).replace('"', "'") in (str(d["ours"]), str(d["ours"]).replace('"', "'")), d


@pytest.mark.parametrize("preset", ["geo3k_qwen2_5_vl_7b", "geo3k_qwen2_5_vl_3b"])
def test_vl_presets_set_nothing_beyond_the_script_but_listed_deviations(preset):
    """Key for key both ways: every verl key of the preset is the script's or a listed deviation (a key added
    silently would make the run differ from verl's example without saying why)."""
    exp = experiment.load(preset)
    listed = {d["key"] for d in exp.spec["deviations"]}
    extra = sorted(set(exp.verl) - set(GUIDES[preset]) - listed)
    assert not extra, f"{preset}: verl keys neither in the script nor in deviations: {extra}"
    assert "image" in exp.spec["model"]["modalities"] and "text" in exp.spec["model"]["modalities"]
    assert exp.spec["datasets"] == {"train": ["geometry3k"], "val": ["geometry3k"]}
    assert exp.spec["evaluation"]["dataset"] == "geometry3k"


def test_the_small_vl_preset_is_the_7b_one_with_the_scripts_model_knob():
    big, small = experiment.load("geo3k_qwen2_5_vl_7b"), experiment.load("geo3k_qwen2_5_vl_3b")
    assert (big.spec["model"]["source"], small.spec["model"]["source"]) == (
        "Qwen/Qwen2.5-VL-7B-Instruct",
        "Qwen/Qwen2.5-VL-3B-Instruct",
    )
    differ = {k for k in {**big.verl, **small.verl} if big.verl.get(k) != small.verl.get(k)}
    assert differ == {"trainer.experiment_name"}, differ


@pytest.mark.parametrize("preset", ["gsm8k_tool_agent_qwen2_5_3b", "dapo_retool_qwen3_4b"])
def test_tool_agent_presets_reach_their_sandbox_service(preset):
    """The tool config ships in the package (so it is in the training image) and carries seed 003's E2BCodeTool
    values (lines 73-77: template code-interpreter-v1, sandbox timeout 300 s, execution timeout 30 s); the
    endpoint is plain env, the API key a Secret reference; the rows are the tool_agent variant."""
    import yaml

    from pipeline_steps.tools import resolve_config_path

    exp = experiment.load(preset)
    path = exp.verl["actor_rollout_ref.rollout.multi_turn.tool_config_path"]
    assert path.startswith("pkg:pipeline_steps.tools/"), path
    (tool,) = yaml.safe_load(open(resolve_config_path(path)))["tools"]
    assert tool["class_name"] == "pipeline_steps.tools.code_sandbox.CodeSandboxTool"
    cfg = tool["config"]
    assert (cfg["e2b_template"], cfg["sandbox_timeout"], cfg["default_timeout"]) == ("code-interpreter-v1", 300, 30)
    assert "e2b_api_key" not in cfg and "e2b_domain" not in cfg  # per deployment, from the environment
    cluster = exp.spec["cluster"]
    # the AGS preset names the guide's service; sandbox-manager's is the deployment's default ($PIPELINE_E2B_DOMAIN)
    assert cluster.get("sandbox_service") == ("ags-shanghai" if preset == "dapo_retool_qwen3_4b" else None)
    assert "E2B_DOMAIN" not in cluster["env"]  # an endpoint and its key come with the service, never the preset
    assert all(s["env"] != "E2B_API_KEY" for s in cluster["secrets"])
    assert exp.spec["datasets"]["variant"] == "tool_agent"


def test_retool_preset_uses_the_guides_region_and_reward():
    from tests.helpers.render import helm_env

    exp = experiment.load("dapo_retool_qwen3_4b")
    services = json.loads(helm_env("PIPELINE_SANDBOX_SERVICES")["PIPELINE_SANDBOX_SERVICES"])  # the shipped values
    assert services[exp.spec["cluster"]["sandbox_service"]]["domain"] == "ap-shanghai.tencentags.com"  # seed 003 l.73
    assert exp.verl["reward.custom_reward_function.path"] == "pkg:pipeline_steps.rewards/retool.py"
    assert exp.spec["datasets"]["train"] == ["dapo_math"] and exp.spec["datasets"]["val"] == ["aime2024"]


@pytest.mark.parametrize("preset", ["geo3k_qwen2_5_vl_7b", "geo3k_qwen2_5_vl_3b"])
def test_the_pixel_limits_are_verls_key_and_bound_the_processors_image_tokens(preset):
    """data.mm_processor_kwargs is where verl 0.9.1 reads the processor's settings (its dataset and its agent loop,
    which also hands them to vLLM per request), and Qwen2.5-VL's image processor (transformers) honours min_pixels /
    max_pixels there: a large figure comes out at most 640 image tokens, inside the 1024-token prompt."""
    import importlib.util
    from pathlib import Path

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    exp = experiment.load(preset)
    kwargs = experiment.mm_processor_kwargs(exp.verl)
    assert kwargs == {"min_pixels": 3136, "max_pixels": 501760}
    assert dict(experiment.compose(exp).data.mm_processor_kwargs) == kwargs  # verl's own config carries them
    verl_dir = Path(list(importlib.util.find_spec("verl").submodule_search_locations)[0])
    assert 'config.get("mm_processor_kwargs"' in (verl_dir / "utils/dataset/rl_dataset.py").read_text()
    assert 'data_config.get("mm_processor_kwargs"' in (verl_dir / "experimental/agent_loop/agent_loop.py").read_text()

    processor = Qwen2VLImageProcessorPil()  # Qwen2.5-VL's: 14-pixel patches merged 2x2, 28x28 pixels per token
    figure = Image.new("RGB", (2000, 1500), "white")

    def tokens(**kw) -> int:  # patches / (2x2 merge)
        return int(processor(images=[figure], return_tensors="np", **kw)["image_grid_thw"].prod()) // 4

    assert tokens() > 1024  # the processor's own limit: the row would be dropped as overlong
    assert tokens(**kwargs) <= kwargs["max_pixels"] // (28 * 28) == 640 < exp.verl["data.max_prompt_length"]
