"""Run planning: revisions as of a date (from the fixture cache's dated revision index), pins, smoke mode, overrides."""

import re
from datetime import datetime, timezone

import pytest

from pipeline_steps.data import revisions
from pipeline_steps.errors import UserError
from pipeline_steps.planning import form, plan, plan_io, run_requests

MOUNTS = '[{"uri": "oss://verl-store", "claim": "verl-store", "path": "/mnt/store"}]'
COMMIT = "a" * 40


def processed(run: dict, splits: dict[str, tuple[str, ...]]) -> list[dict]:
    """The plan's datasets as upload left them (download's commit, preprocess's splits, upload's version URI)."""
    return [
        {
            **item,
            "download": {"commit": COMMIT, "repo_id": f"org/{item['dataset']}"},
            "preprocess": {"splits": {s: "x" for s in splits[item["dataset"]]}, "content_hash": "c" * 64},
            "upload": {"uri": f"{run['store']}/datasets/{item['dataset']}/{COMMIT}/fp"},
        }
        for item in run["datasets"]
    ]


def at(day: str) -> datetime:
    return datetime.fromisoformat(day).replace(tzinfo=timezone.utc)


def test_revision_as_of_date(offline_hub):
    v1, v2 = (r["commit"] for r in offline_hub["index"]["openai/gsm8k"])
    assert revisions.resolve("openai/gsm8k", at("2026-09-01"))["commit"] == v1  # the commit's own date counts
    assert revisions.resolve("openai/gsm8k", at("2026-10-14"))["commit"] == v1
    assert revisions.resolve("openai/gsm8k", at("2026-10-15"))["commit"] == v2
    with pytest.raises(UserError, match="no commit at or before"):
        revisions.resolve("openai/gsm8k", at("2026-08-31"))


def test_plan_resolves_pins_and_smoke(offline_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.delenv("PIPELINE_STORE_URI", raising=False)
    run = plan.plan(
        {
            "experiment": "local_tiny",
            "smoke": True,
            "dataset_revisions": {"aime2024": "v1"},
            "prepare_datasets": ["dapo_math"],
        },
        at("2026-10-20"),
        "backfill__2026-10-20T00:00:00+00:00",
        "d",
    )
    items = {d["dataset"]: d for d in run["datasets"]}
    assert (
        items["gsm8k"]["role"] == "train"
        and items["gsm8k"]["revision"] == offline_hub["index"]["openai/gsm8k"][1]["commit"]
    )
    assert items["aime2024"]["role"] == "eval" and items["aime2024"]["revision"] == "v1"
    assert items["aime2024"]["resolved"] == {"source": "pinned"}
    assert items["dapo_math"]["role"] == "prepare"
    assert all(d["limit"] == plan.SMOKE_ROWS for d in run["datasets"])
    assert run["store"] == f"file://{tmp_path / 'store'}" and ":" not in run["run_key"] and "+" not in run["run_key"]
    with pytest.raises(UserError, match="not a downloadable registry entry"):
        plan.plan({"datasets": ["nope"]}, None, "r", "d")


def test_form_hyperparameters_become_overrides_user_last():
    out = form.overrides(
        {
            "learning_rate": 1e-6,
            "rollout_n": 8,
            "kl_coef": 0.001,
            "smoke": True,
            "verl_overrides": ["actor_rollout_ref.rollout.n=4"],
        }
    )
    assert out[0] == "actor_rollout_ref.actor.optim.lr=1e-06" and "actor_rollout_ref.actor.use_kl_loss=true" in out
    assert "trainer.total_training_steps=1" in out and out[-1] == "actor_rollout_ref.rollout.n=4"


def test_the_plan_holds_what_later_tasks_read_and_is_written_once(monkeypatch, tmp_path):
    """Issue 25: the plan keeps the preset as read, the backend, the overrides and the evaluation settings; the
    experiment an operator rebuilds from it is the one a fresh read would give, and plan.json reads back equal."""
    import json

    from pipeline_steps.training import experiment

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    monkeypatch.delenv("PIPELINE_STORE_URI", raising=False)
    params = {"experiment": "local_tiny", "learning_rate": 1e-5, "kl_coef": 0.01, "smoke": True}
    run = plan.plan(params, None, "manual__1", "d")
    assert run["backend"] == "local" and run["overrides"] == form.overrides(params)
    assert run["eval_dataset"] == "aime2024" and run["val_datasets"] == ["gsm8k"] and run["mounts"] == []
    assert run["evaluation"]["k"] == 4 and run["evaluation"]["tensor_parallel_size"] == 1
    assert json.loads(json.dumps(run)) == run  # XCom and plan.json carry it as is
    derived = {"data.train_files": ["/x/train.parquet"], "trainer.default_local_dir": "/x/checkpoints"}
    fresh = experiment.load("local_tiny", run["overrides"], derived)
    rebuilt = experiment.from_plan(run, derived)
    assert (rebuilt.name, rebuilt.spec, rebuilt.verl) == (fresh.name, fresh.spec, fresh.verl)
    assert list(rebuilt.verl) == list(fresh.verl)  # the same order: the user's overrides applied last
    assert run["preset_sha256"] == experiment.load("local_tiny").digest()
    uri = plan_io.save(run)
    assert uri == f"{run['run_dir']}/plan.json" and plan_io.load(run["run_dir"]) == run
    with pytest.raises(UserError, match="no plan there"):
        plan_io.load(f"file://{tmp_path}/elsewhere")


def test_cluster_evaluation_shards_the_model_over_the_jobs_gpus(monkeypatch):
    """A 32B model does not fit one GPU: the kuberay evaluate job's vLLM gets tensor parallelism over the GPUs the
    job's worker has (the preset's gpus_per_node, or the form's); the local (hf) evaluation gets no such flag."""
    monkeypatch.setenv("PIPELINE_MOUNTS", MOUNTS)
    staged = {"model": "Qwen/Qwen2.5-32B-Instruct", "stage_model": {"uri": "oss://verl-store/models/q/main"}}
    trained = {"checkpoint_uri": "oss://verl-store/verl/runs/x/r/checkpoints"}
    base = {"experiment": "gsm8k_qwen2_5_32b", "store_uri": "oss://verl-store/verl", "eval_dataset": "gsm8k"}
    for params, want in (({"backend": "kuberay"}, "8"), ({"backend": "kuberay", "gpus_per_node": 4}, "4")):
        planned = plan.plan({**base, **params}, None, "r", "d")
        inputs = run_requests.collect(processed(planned, {"gsm8k": ("train", "test")}), staged, planned)
        argv = run_requests.evaluate_request(inputs, trained, planned)["args"]
        assert argv[argv.index("--generator") + 1] == "vllm"
        assert argv[argv.index("--tensor-parallel-size") + 1] == want
        assert argv[argv.index("--name") + 1] == "gsm8k"  # the registry's name, not the scorer's data_source
    local = plan.plan({**base, "backend": "local"}, None, "r", "d")
    inputs = run_requests.collect(processed(local, {"gsm8k": ("train", "test")}), staged, local)
    assert "--tensor-parallel-size" not in run_requests.evaluate_request(inputs, trained, local)["args"]


def test_kuberay_refuses_a_store_the_pods_cannot_reach(offline_hub, monkeypatch):
    """Issue 13: a kuberay run with the store on the worker's disk (file://) or on an unmounted bucket fails in the
    plan task, in one line, instead of at render time after downloading and uploading the data."""
    monkeypatch.setenv("PIPELINE_MOUNTS", '[{"uri": "oss://verl-store", "claim": "verl-store", "path": "/mnt/store"}]')
    base = {"experiment": "gsm8k_qwen2_5_3b", "backend": "kuberay"}
    for store in ("file:///tmp/store", "oss://other-bucket/verl"):
        with pytest.raises(UserError, match=r"^store_uri .*: the kuberay backend .*\(mounts: oss://verl-store\)") as e:
            plan.plan({**base, "store_uri": store}, None, "r", "d")
        assert "\n" not in str(e.value)
    ok = plan.plan({**base, "store_uri": "oss://verl-store/verl", "dataset_revisions": {}}, None, "r", "d")
    assert ok["store"] == "oss://verl-store/verl"
    # the local backend keeps any store
    assert plan.plan({**base, "backend": "local", "store_uri": "file:///tmp/store"}, None, "r", "d")["store"]


@pytest.mark.parametrize("params", [{"datasets": ["geometry3k"]}, {"eval_dataset": "geometry3k"}])
def test_image_rows_for_a_text_only_model_are_refused_before_any_download(params, offline_hub, monkeypatch, tmp_path):
    """verl's RLHFDataset asserts "processor is needed to process multimodal data" at job start, after the GPUs
    were granted: plan refuses it in one line naming the dataset, the model and the fix."""
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    with pytest.raises(UserError) as err:
        plan.plan({"experiment": "gsm8k_qwen2_5_3b", **params}, None, "r", "d")
    msg = str(err.value)
    assert "\n" not in msg and "'geometry3k'" in msg and "Qwen/Qwen2.5-3B-Instruct" in msg and "text-only" in msg
    assert "prepare_datasets" in msg
    # the fix names the presets that read images (issue 30), from their models (issue 47: gspo's Qwen3.5 and the
    # tiny VL model read images; the text-only local_tiny does not)
    named = set(re.search(r"reads images \(([^)]*)\)", msg).group(1).split(", "))
    assert named == {"geo3k_qwen2_5_vl_7b", "geo3k_qwen2_5_vl_3b", "gspo", "local_tiny_vl"}
    # preparing it (no training on it) stays possible
    run = plan.plan({"experiment": "local_tiny", "prepare_datasets": ["geometry3k"]}, None, "r", "d")
    assert {d["dataset"]: d["role"] for d in run["datasets"]}["geometry3k"] == "prepare"


@pytest.mark.parametrize("preset", ["geo3k_qwen2_5_vl_7b", "geo3k_qwen2_5_vl_3b"])
@pytest.mark.parametrize(
    "params,train,evaluated",
    [
        ({}, "geometry3k", "geometry3k"),  # the preset's own: train and validate on geometry3k, evaluate on its test
        ({"datasets": ["gsm8k"], "eval_dataset": "aime2024"}, "gsm8k", "aime2024"),  # text rows: a VLM reads text too
    ],
)
def test_vision_language_presets_take_image_and_text_datasets(preset, params, train, evaluated, monkeypatch):
    monkeypatch.setenv("PIPELINE_MOUNTS", '[{"uri": "oss://verl-store", "claim": "verl-store", "path": "/mnt/store"}]')
    run = plan.plan({"experiment": preset, "store_uri": "oss://verl-store/verl", **params}, None, "r", "d")
    roles = {d["dataset"]: d["role"] for d in run["datasets"]}
    assert roles[train] == "train" and roles[evaluated] in ("eval", "train"), roles
    assert run["model"]["carry"]["model"].startswith("Qwen/Qwen2.5-VL-")


def test_vl_evaluation_is_geometry3ks_test_split_with_the_trainings_pixel_limits(monkeypatch):
    """The VL presets evaluate on geometry3k's test split (601 problems upstream; its data_source selects verl's geo3k
    scorer) and the evaluate job scales figures as training does: the preset's data.mm_processor_kwargs, or the
    form's override of them."""
    import json

    monkeypatch.setenv("PIPELINE_MOUNTS", MOUNTS)
    uri = f"oss://verl-store/verl/datasets/geometry3k/{COMMIT}/fp"
    splits = {"geometry3k": ("train", "validation", "test"), "gsm8k": ("train", "test")}
    staged = {"model": "Qwen/Qwen2.5-VL-3B-Instruct", "stage_model": {"uri": "oss://verl-store/models/q/main"}}
    trained = {"checkpoint_uri": "oss://verl-store/verl/runs/x/r/checkpoints"}
    base = {"backend": "kuberay", "store_uri": "oss://verl-store/verl"}
    for params, want in (
        ({}, {"max_pixels": 501760, "min_pixels": 3136}),
        (
            {"verl_overrides": ["data.mm_processor_kwargs.max_pixels=200704"]},
            {"max_pixels": 200704, "min_pixels": 3136},
        ),
    ):
        planned = plan.plan({**base, "experiment": "geo3k_qwen2_5_vl_3b", **params}, None, "r", "d")
        inputs = run_requests.collect(processed(planned, splits), staged, planned)
        assert inputs["eval_file"] == f"{uri}/test.parquet" and inputs["val_files"] == [f"{uri}/test.parquet"]
        argv = run_requests.evaluate_request(inputs, trained, planned)["args"]
        assert argv[argv.index("--name") + 1] == "geometry3k" and argv[argv.index("--generator") + 1] == "vllm"
        assert json.loads(argv[argv.index("--mm-processor-kwargs") + 1]) == want
    # a text preset passes no processor settings (image rows for it are refused by the plan)
    run_text = plan.plan(
        {**base, "experiment": "gsm8k_qwen2_5_3b", "datasets": ["gsm8k"], "eval_dataset": "gsm8k"},
        None,
        "r",
        "d",
    )
    inputs = run_requests.collect(processed(run_text, splits), staged, run_text)
    argv = run_requests.evaluate_request(inputs, trained, run_text)["args"]
    assert "--mm-processor-kwargs" not in argv
