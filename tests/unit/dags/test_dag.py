"""The DAG file: parses fast without heavy imports, has the whole chain, and its trigger form rejects bad values."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DAG_FILE = ROOT / "dags" / "verl_grpo_pipeline.py"
HEAVY = {"torch", "ray", "verl", "pandas", "datasets", "transformers", "vllm", "pyarrow"}
# clients a DAG processor must not load to parse the file (the jobs' hooks import them when a task reaches a job)
CLIENTS = {"kubernetes", "kubernetes_asyncio", "kubernetes_validate", "google", "alibabacloud_oss_v2", "aiohttp"}


def test_parses_fast_without_heavy_imports():
    code = f"""
import runpy, sys, time
import airflow.sdk  # the DAG processor has the Task SDK loaded already
before = set(sys.modules)
t = time.process_time()  # CPU time: wall time on a loaded 2-core CI box is noise
runpy.run_path({str(DAG_FILE)!r})
dt = time.process_time() - t
print(dt, ",".join(sorted({{m.split('.')[0] for m in set(sys.modules) - before}})))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "AIRFLOW__CORE__LOAD_EXAMPLES": "False"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, modules = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert not (HEAVY | CLIENTS) & set(modules.split(",")), modules
    assert float(seconds) < 0.5, f"DAG parse took {seconds} s of CPU (0.11 s measured without the Kubernetes clients)"


@pytest.fixture(scope="module")
def dag():
    import runpy

    return runpy.run_path(str(DAG_FILE))["dag"]


def test_chain_and_task_settings(dag):
    ids = set(dag.task_ids)
    for name in ("download", "preprocess", "upload_dataset", "stage_model", "train", "evaluate", "export"):
        assert name in ids
    order = [
        "plan",
        "download",
        "preprocess",
        "upload_dataset",
        "collect_inputs",
        "train",
        "evaluate",
        "export",
        "report",
    ]
    for a, b in zip(order, order[1:]):  # b runs after a (directly, or through a small request-builder task)
        assert b in dag.get_task(a).get_flat_relative_ids(upstream=False), (a, b)
    assert dag.get_task("report").trigger_rule == "all_done"
    for t in dag.tasks:
        assert t.retries >= 1 and t.retry_exponential_backoff and t.execution_timeout is not None, t.task_id
    assert dag.get_task("train").pool == "gpu" and dag.get_task("evaluate").pool == "gpu"
    assert dag.max_active_runs == 1 and not dag.catchup


BAD = [
    ({"experiment": "does_not_exist"}, "experiment"),
    ({"backend": "slurm"}, "backend"),
    ({"datasets": ["GSM8K; rm -rf /"]}, "datasets"),
    ({"datasets": ["gsm8k", "gsm8k"]}, "datasets"),
    ({"dataset_revisions": {"gsm8k": "$(whoami)"}}, "dataset_revisions"),
    ({"model": "../../etc/passwd"}, "model"),
    ({"learning_rate": -1}, "learning_rate"),
    ({"learning_rate": "fast"}, "learning_rate"),
    ({"rollout_n": 0}, "rollout_n"),
    ({"rollout_n": 2.5}, "rollout_n"),
    ({"nnodes": 0}, "nnodes"),
    ({"verl_overrides": ["no equals sign"]}, "verl_overrides"),
    ({"verl_overrides": ["; echo pwned=1"]}, "verl_overrides"),
    ({"store_uri": "s3://bucket"}, "store_uri"),
    ({"train_jsonl": "ftp://host/rows.jsonl"}, "train_jsonl"),
    ({"train_jsonl": "file:///data/rows.csv"}, "train_jsonl"),
    ({"train_jsonl": "hf://org/model/rows.jsonl"}, "train_jsonl"),  # a model repository: datasets only
    ({"validation_jsonl": "file:///data/$(whoami).jsonl"}, "validation_jsonl"),
    ({"smoke": "yes"}, "smoke"),
    # issue 46: the form's schema carries the allow-list's keys, its numeric ranges and its size limits
    ({"total_training_steps": 10**12}, "total_training_steps"),
    ({"train_batch_size": 10**9}, "train_batch_size"),
    ({"kl_coef": 1000}, "kl_coef"),
    ({"gpus_per_node": 0}, "gpus_per_node"),
    ({"verl_overrides": ["trainer.experiment_name=" + "x" * (10 * 1024 * 1024)]}, "verl_overrides"),
    ({"verl_overrides": ["trainer.save_freq=1"] * 1000}, "verl_overrides"),
    ({"store_uri": "file:///" + "d" * 5000}, "store_uri"),
    ({"datasets": [f"d{i}" for i in range(1000)]}, "datasets"),
    ({"dataset_revisions": {f"d{i}": "main" for i in range(1000)}}, "dataset_revisions"),
    ({"experiment": "local_tool_learning"}, "experiment"),  # for make demo-tools only (form: false)
]


@pytest.mark.parametrize("conf,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_trigger_form_rejects_bad_values(dag, conf, field):
    from airflow.sdk.exceptions import ParamValidationError

    params = copy.deepcopy(dag.params)
    with pytest.raises(ParamValidationError) as err:
        params.update(conf)
        params.validate()
    assert field in str(err.value)


def _form_probes():
    from tests.helpers.form_probes import PROBES

    return [override for override, _, _ in PROBES]


@pytest.mark.parametrize("override", _form_probes(), ids=[p.split("=")[0][-40:] for p in _form_probes()])
def test_trigger_form_refuses_every_probe_of_issue_46(dag, override):
    """The form's JSON schema lets through only the reviewed keys (pipeline_steps/training/form_keys.py): each probe
    of issue 46 (ray_kwargs, paths, trust_remote_code, critic.model.path, any other key) is refused in the form, before
    the plan task refuses it again (tests/unit/pipeline_steps/training/test_form_allow_list.py)."""
    from airflow.sdk.exceptions import ParamValidationError

    params = copy.deepcopy(dag.params)
    with pytest.raises(ParamValidationError) as err:
        params.update({"verl_overrides": [override]})
        params.validate()
    assert "verl_overrides" in str(err.value)
    params = copy.deepcopy(dag.params)
    params.update(
        {"verl_overrides": ["actor_rollout_ref.actor.optim.lr=2e-6", "+data.mm_processor_kwargs.max_pixels=1"]}
    )
    assert params.validate()["verl_overrides"][0] == "actor_rollout_ref.actor.optim.lr=2e-6"


def test_every_numeric_field_has_a_range_and_every_string_or_array_a_size_limit(dag):
    for name, param in dag.params.items():
        schema = param.schema
        types = schema.get("type")
        types = set(types if isinstance(types, list) else [types])
        if types & {"number", "integer"}:
            assert "maximum" in schema and ("minimum" in schema or "exclusiveMinimum" in schema), name
        if "string" in types and "enum" not in schema:
            assert schema.get("maxLength"), name
        if "array" in types:
            assert schema.get("maxItems") and schema["items"].get("maxLength", 64) <= 512, name
            assert schema["items"].get("pattern") or schema["items"].get("enum"), name
        if "object" in types:
            assert schema.get("maxProperties"), name


def test_trigger_form_accepts_a_full_form(dag):
    params = copy.deepcopy(dag.params)
    params.update(
        {
            "experiment": "local_tiny",
            "backend": "local",
            "datasets": ["gsm8k", "dapo_math"],
            "smoke": True,
            "dataset_revisions": {"gsm8k": "a" * 40},
            "learning_rate": 1e-6,
            "rollout_n": 8,
            "nnodes": 2,
            "verl_overrides": ["actor_rollout_ref.actor.clip_ratio_high=0.28"],
            "store_uri": "oss://bucket/verl",
            "train_jsonl": "hf://datasets/my-org/my-data@refs%2Fpr%2F1/data/train.jsonl",
            "validation_jsonl": "oss://bucket/data/val.jsonl",
        }
    )
    assert params.validate()["rollout_n"] == 8


def test_every_optional_field_allows_null_so_the_form_needs_no_input(dag):
    """Airflow's trigger form marks a field required unless its schema allows null (checked in the UI on this
    machine): a field whose default is empty must be ["null", <type>] with a None default."""
    for name, param in dag.params.items():
        value, schema = param.value, param.schema
        types = schema.get("type")
        types = types if isinstance(types, list) else [types]
        if value in (None, "", [], {}):
            assert value is None and "null" in types, (name, value, types)
        else:
            assert value not in ("", [], {}), name
    assert copy.deepcopy(dag.params).validate()["experiment"] == "local_tiny"


def test_the_default_presets_values_show_in_the_fields_they_fill(dag):
    assert "local_tiny: gsm8k" in dag.params.get_param("datasets").description
    assert "local_tiny: tiny" in dag.params.get_param("model").description
    assert "local_tiny: 4" in dag.params.get_param("rollout_n").description


def test_the_form_to_verl_table_has_one_home(dag, monkeypatch):
    """Issue 25: the form's fields that set verl keys are one table (pipeline_steps/planning/form.py); the form's
    Params, the plan's overrides and the preset values the form shows all read it, and no other file spells a key."""
    import inspect

    from pipeline_steps.planning import form, plan

    for name, field in form.FIELDS.items():
        schema = dag.params.get_param(name).schema
        assert {k: schema.get(k) for k in field.schema} == field.schema, name
        assert (schema["title"], schema["section"]) == (field.title, field.section), name
    assert not hasattr(plan, "HYPERPARAMETERS")
    for text in (DAG_FILE.read_text(), inspect.getsource(plan), inspect.getsource(form.preset_summary)):
        assert not [f.verl_key for f in form.FIELDS.values() if f.verl_key in text], text[:200]
    # the preset values the form shows come through the table: a field added to it shows its preset value
    probe = form.Field("data.max_prompt_length", "Prompt length")
    monkeypatch.setitem(form.FIELDS, "max_prompt_length", probe)
    assert form.preset_summary("local_tiny")["max_prompt_length"] == "256"
    assert form.overrides({"max_prompt_length": 128}) == ["data.max_prompt_length=128"]


def test_asset_names_read_like_versions():
    from operators.assets import asset_name

    assert asset_name("file:///data/store/datasets/gsm8k/00f29045abcdef/9007d73aa11") == "gsm8k@00f2904 (9007d73)"
    assert asset_name("oss://bkt/verl/datasets/dapo_math/" + "a" * 40 + "/" + "b" * 16) == "dapo_math@aaaaaaa (bbbbbbb)"
    assert asset_name("gs://bkt/models/exported/gsm8k_qwen/step20-0f4bd6546423") == "gsm8k_qwen@step20-0f4bd6546423"


def test_only_the_registration_tasks_emit_assets_and_they_run_one_at_a_time(dag):
    """Airflow 3.3 creates an alias-emitted Asset inside the success call, racing a concurrent creator
    (operators/assets.py): every AssetAlias outlet of the DAG must sit on a task that runs alone across runs."""
    emitting = {
        t.task_id: t.max_active_tis_per_dag
        for t in dag.tasks
        if any(o.__class__.__name__ == "AssetAlias" for o in t.outlets)
    }
    assert emitting == {"register_datasets": 1, "register_model": 1}
    assert dag.get_task("register_datasets").upstream_task_ids == {"upload_dataset"}
    assert dag.get_task("register_model").upstream_task_ids == {"export"}


def test_registration_emits_each_version_with_its_lineage():
    from airflow.sdk import AssetAlias
    from airflow.sdk.execution_time.context import OutletEventAccessors

    from operators.assets import RegisterAssetsOperator

    uploads = [
        {
            "dataset": "gsm8k",
            "revision": "abc",
            "preprocess": {"rows_out": 7, "content_hash": "h1"},
            "upload": {"uri": "file:///s/datasets/gsm8k/abc/h1", "uploaded": 0},
        },
        {"dataset": "aime2024", "revision": "def", "upload": {"uri": "file:///s/datasets/aime2024/def/h2"}},
        {"dataset": "x", "upload": {}},  # no output: nothing to register
    ]
    op = RegisterAssetsOperator(task_id="register_datasets", asset_alias="a", results=uploads, summary_key="upload")
    ctx = {"run_id": "r1", "outlet_events": OutletEventAccessors()}
    assert op.execute(ctx) == ["file:///s/datasets/gsm8k/abc/h1", "file:///s/datasets/aime2024/def/h2"]
    events = ctx["outlet_events"][AssetAlias("a")].asset_alias_events
    assert [(e.dest_asset_key.name, e.extra["rows_out"] if "rows_out" in e.extra else None) for e in events] == [
        ("gsm8k@abc (h1)", 7),
        ("aime2024@def (h2)", None),
    ]
    assert events[0].extra["run_id"] == "r1" and events[0].extra["content_hash"] == "h1"


def test_readme_defaults_weekly_schedule_local_tiny_and_failure_callbacks_on_every_task(dag):
    """README: weekly by default, catchup off, one active run; scheduled runs train local_tiny on the local backend;
    every task reports its failure (operators.notify.notify_failure); the report runs after a failed task."""
    from airflow.sdk import TriggerRule

    from operators.notify import notify_failure

    assert dag.timetable.expression == "0 0 * * 0" and dag.catchup is False and dag.max_active_runs == 1  # @weekly
    assert dag.params["experiment"] == "local_tiny" and dag.params["backend"] == "local"
    missing = [t.task_id for t in dag.tasks if notify_failure not in (t.on_failure_callback or [])]
    assert not missing, missing
    for task_id in ("report_request", "report"):
        assert dag.get_task(task_id).trigger_rule == TriggerRule.ALL_DONE


def test_the_evaluation_dag_is_scheduled_on_what_the_pipeline_registers_for_each_export(dag):
    import runpy

    from airflow.sdk import AssetAlias

    evaluation = runpy.run_path(str(ROOT / "dags" / "verl_evaluate_model.py"))["dag"]
    (emitted,) = dag.get_task("register_model").outlets
    assert evaluation.timetable.asset_condition == AssetAlias(emitted.name) == AssetAlias("verl-exported-models")


def test_the_form_offers_every_preset_the_vision_language_ones_included(dag):
    """The experiment field's choices are the presets directory's (issue 30: the geometry3k VL presets appear beside
    the local and text presets, which stay)."""
    from pipeline_steps.training import experiment

    enum = dag.params.get_param("experiment").schema["enum"]
    assert enum == experiment.preset_names(offered=True)
    assert {"geo3k_qwen2_5_vl_7b", "geo3k_qwen2_5_vl_3b", "local_tiny", "local_arithmetic", "gsm8k_qwen2_5_3b"} <= set(
        enum
    )
    # issue 46: a preset meant only for `make demo-tools` (form: false) is not offered; every other one is (issue 47:
    # local_tiny_vl too, since the evaluate step generates from images on CPU)
    assert set(experiment.preset_names()) - set(enum) == {"local_tool_learning"}
    assert "local_tiny_vl" in enum
