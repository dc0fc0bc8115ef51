"""Export: a REAL verl FSDP checkpoint (tests/helpers/fsdp_checkpoint.py: two gloo processes on CPU, verl's
own FSDPCheckpointManager) merged by verl's merger, checked with transformers, carded, uploaded to
the real file:// store and gated. Nothing is mocked; the Hugging Face Hub push is not exercised
(no Hub access here).
"""

import json
import shutil

import pytest

from pipeline_steps import cli
from pipeline_steps.errors import UserError
from pipeline_steps.training.checkpoints import check_model, dir_sha256, merge_checkpoint, resolve_checkpoint
from tests.helpers import fsdp_checkpoint
from tests.helpers.eval_results import LINEAGE, export_results

pytestmark = pytest.mark.slow  # about 17 s of CPU: a verl FSDP checkpoint built and merged


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_model):
    checkpoints = fsdp_checkpoint.cached_build(tmp_path_factory.getbasetemp(), tiny_model, steps=(1, 2))
    return {"model": tiny_model, "checkpoints": checkpoints}


def copy_checkpoints(ckpt, tmp_path):
    dst = tmp_path / "checkpoints"
    shutil.copytree(ckpt["checkpoints"], dst)
    return dst


def run_cli(argv, capsys):
    """In-process CLI run: (exit code, JSON summary, stderr). On failure stderr must end in exactly one error line."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    if code:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-2000:]
    return code, json.loads(out.strip().splitlines()[-1]), err


def test_merged_weights_equal_source_weights(ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    step, actor = resolve_checkpoint(ckpt["checkpoints"])
    assert step == 2 and actor.name == "actor"
    merged = merge_checkpoint(actor, tmp_path / "merged")
    got = load_file(merged / "model.safetensors")
    ref = torch.load(ckpt["checkpoints"] / "reference_state_dict.pt", weights_only=True)
    base = AutoModelForCausalLM.from_pretrained(ckpt["model"]).state_dict()
    assert set(got) <= set(ref) and set(ref) - set(got) <= {"lm_head.weight"}  # tied head is dropped by the merger
    changed = 0
    for key, tensor in got.items():
        assert tensor.dtype == torch.bfloat16  # verl's merger writes bf16
        assert torch.equal(tensor, ref[key].to(torch.bfloat16)), key
        changed += not torch.equal(tensor, base[key].to(torch.bfloat16))
    assert changed > len(got) // 2  # the optimizer step moved the weights: we did not merge the base model
    info = check_model(merged)
    assert (
        info["generated_tokens"] >= 1
        and info["parameters"] == sum(p.numel() for p in base.values()) - base["lm_head.weight"].numel()
    )


def test_missing_fsdp_config_says_how_to_fix(ckpt, tmp_path, capsys):
    cks = copy_checkpoints(ckpt, tmp_path)
    (cks / "global_step_2" / "actor" / "fsdp_config.json").unlink()
    with pytest.raises(UserError, match=r'create it with the content \{"FSDP_version": 1, "world_size": 2\}'):
        resolve_checkpoint(cks)
    code, summary, err = run_cli(_export_args(cks, tmp_path, f"file://{tmp_path}/store", 0.9), capsys)
    assert code == 2 and not summary["ok"] and "fsdp_config.json: missing" in summary["error"]
    assert not (tmp_path / "store").exists()  # nothing uploaded, nothing promoted


def test_bad_checkpoint_dirs_give_one_clear_line(ckpt, tmp_path):
    cks = copy_checkpoints(ckpt, tmp_path)
    (cks / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(UserError, match="no latest_checkpointed_iteration.txt.*pass --step N"):
        resolve_checkpoint(cks)
    assert resolve_checkpoint(cks, step=1)[0] == 1
    (cks / "global_step_3" / "actor").mkdir(parents=True)
    (cks / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(UserError, match="global_step_3: empty checkpoint"):
        resolve_checkpoint(cks)
    (cks / "global_step_1" / "actor" / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(UserError, match=r"ranks \[1\] of world size 2 are missing"):
        resolve_checkpoint(cks, step=1)
    with pytest.raises(UserError, match="available: .*global_step_2"):
        resolve_checkpoint(cks, step=9)


def _write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def _export_args(cks, tmp_path, store_root, avg, step=None, extra=()):
    args = [
        "export",
        "--checkpoint-dir",
        str(cks),
        "--output",
        str(tmp_path / f"out{step}"),
        "--store-root",
        store_root,
        "--experiment",
        "local_tiny",
        "--lineage",
        _write(tmp_path, "lineage.json", LINEAGE),
        "--eval-results",
        _write(tmp_path, f"results{avg}.json", export_results(avg)),
        "--base-results",
        _write(tmp_path, "base.json", export_results(0.25)),
        "--keep",
        "1",
        *extra,
    ]
    return args + (["--step", str(step)] if step is not None else [])


def test_export_end_to_end_card_upload_promotion_retry(ckpt, tmp_path, capsys):
    from pipeline_steps.store import open_store

    store_root = f"file://{tmp_path}/store"
    store = open_store(store_root)
    code, s, err = run_cli(_export_args(ckpt["checkpoints"], tmp_path, store_root, 0.5), capsys)
    assert code == 0, err
    assert s["promoted"] and "beats the base model" in s["reason"] and s["step"] == 2
    assert s["uri"] == f"{store_root}/models/exported/local_tiny/{s['version']}" and s["version"].startswith("step2-")
    manifest = store.read_manifest(s["uri"])
    paths = {f["path"] for f in manifest["files"]}
    assert {"README.md", "export.json", "config.json", "model.safetensors", "tokenizer.json"} <= paths
    card = store.read_bytes(f"{s['uri']}/README.md").decode()
    for needle in [
        "rev-0a1b2c",
        "c0ffee" * 4,
        "beef" * 6,
        "e53f048",
        "ab" * 32,
        "cd" * 32,
        "trainer.total_training_steps=3",
        "0.9.1",
        "verl_grpo_pipeline",
        "manual__2026-11-22T03:00:00+00:00",
        "| avg@2 | 50.0% | 25.0% | +25.0 pt |",
        "base_model: local/tiny",
        "promoted to latest",
    ]:
        assert needle in card, needle
    latest = json.loads(store.read_bytes(f"{store_root}/models/exported/local_tiny/latest.json"))
    assert latest["version"] == s["version"] and latest["avg@k"] == 0.5

    # retry after success: same version, nothing re-sent, still latest
    code, again, err = run_cli(_export_args(ckpt["checkpoints"], tmp_path, store_root, 0.5), capsys)
    assert code == 0, err
    assert again["version"] == s["version"] and again["uploaded"] == 0 and again["promoted"]

    # an older step scoring worse stays a candidate; with --fail-on-no-promotion the task fails with one line
    code, worse, err = run_cli(_export_args(ckpt["checkpoints"], tmp_path, store_root, 0.4, step=1), capsys)
    assert code == 0 and not worse["promoted"] and "stays a candidate" in worse["reason"]
    assert worse["deleted_versions"] == [] or s["version"] not in worse["deleted_versions"]
    assert (
        json.loads(store.read_bytes(f"{store_root}/models/exported/local_tiny/latest.json"))["version"] == s["version"]
    )
    code, failed, err = run_cli(
        _export_args(ckpt["checkpoints"], tmp_path, store_root, 0.4, step=1, extra=["--fail-on-no-promotion"]), capsys
    )
    assert code == 2 and "not promoted" in failed["error"]
    versions = [u.rsplit("/", 1)[-1] for u in store.list_versions(f"{store_root}/models/exported/local_tiny")]
    assert s["version"] in versions and len(versions) <= 2  # keep=1 plus the protected latest


def test_merged_model_that_fails_to_load_is_not_exported(ckpt, tmp_path, capsys):
    cks = copy_checkpoints(ckpt, tmp_path)
    cfg_path = cks / "global_step_2" / "actor" / "huggingface" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] += 7  # merge still writes weights, loading hits a shape mismatch
    cfg_path.write_text(json.dumps(cfg))
    store_root = f"file://{tmp_path}/store"
    code, s, err = run_cli(_export_args(cks, tmp_path, store_root, 0.9), capsys)
    assert code == 2 and "fails to load or generate" in s["error"] and "nothing was exported or promoted" in s["error"]
    assert not (tmp_path / "store" / "models").exists()


def test_model_card_with_sparse_lineage_says_not_recorded():
    from pipeline_steps.evaluation import model_card

    res = export_results(0.5)
    res["overall"]["k"] = 1
    res["overall"]["pass@k"] = {"1": 0.5}
    card = model_card.render({"version": "step1-x", "experiment": "e", "lineage": {}}, res, None)
    assert card.count("not recorded") >= 5 and "| avg@1 | 50.0% | — | — |" in card
    assert card.count("| pass@1 |") == 1  # k = 1: pass@1 and pass@k are one row


def test_eval_results_of_another_model_are_rejected(ckpt, tmp_path, capsys):
    store_root = f"file://{tmp_path}/store"
    argv = _export_args(ckpt["checkpoints"], tmp_path, store_root, 0.9)
    res = export_results(0.9)
    res["model"] = {"content_sha256": dir_sha256(ckpt["model"]), "source": "hf_model"}  # the base model's hash
    argv[argv.index("--eval-results") + 1] = _write(tmp_path, "other.json", res)
    code, s, _ = run_cli(argv, capsys)
    assert code == 2 and "scored a different model" in s["error"] and not (tmp_path / "store").exists()
    # the hash evaluate records for this checkpoint is accepted
    step, actor = resolve_checkpoint(ckpt["checkpoints"])
    res["model"] = {
        "content_sha256": dir_sha256(merge_checkpoint(actor, tmp_path / "m")),
        "source": "checkpoint",
    }
    argv[argv.index("--eval-results") + 1] = _write(tmp_path, "same.json", res)
    code, s, err = run_cli(argv, capsys)
    assert code == 0 and s["promoted"], err


@pytest.mark.slow  # the tiny VL model built and loaded: about 5 s of CPU
def test_a_vision_language_model_is_checked_as_a_user_loads_it(tiny_vl_model, tiny_model):
    """export's load-and-generate check takes a VL model through AutoProcessor and AutoModelForImageTextToText with
    an image (a local_tiny_vl DAG run's export once failed: AutoModelForCausalLM does not load Qwen2.5-VL)."""
    info = check_model(tiny_vl_model)
    assert info["generated_tokens"] >= 1 and info["parameters"] == 190944
    assert check_model(tiny_model)["generated_tokens"] >= 1  # a text model as before
