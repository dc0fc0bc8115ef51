"""Promotion gate and retention against the real store (file:// backend of pipeline_steps.store).

Gate cases: better, worse, equal within margin, no previous latest (compared with the base),
incomparable evaluations. Retention keeps the newest N and never deletes the latest.
"""

import json

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.evaluation import promotion
from pipeline_steps.store import open_store
from tests.helpers.eval_results import BASE, results


def latest_of(avg, **kw):
    return {"version": "step1-aaaa", **promotion.summary_of(results(avg, **kw))}


def test_better_than_latest_is_promoted():
    d = promotion.decide(results(0.50), BASE, latest_of(0.40), margin=0.05)
    assert d.promote and d.reference == "latest" and d.reference_score == 0.40
    assert "beats the latest step1-aaaa" in d.reason


def test_worse_than_latest_stays_candidate_even_if_better_than_base():
    d = promotion.decide(results(0.30), BASE, latest_of(0.40), margin=0.0)
    assert not d.promote and d.reference == "latest"
    assert "stays a candidate" in d.reason and "-0.1000" in d.reason


@pytest.mark.parametrize("cand,ref,margin", [(0.40, 0.40, 0.0), (0.42, 0.40, 0.02), (0.41, 0.40, 0.05)])
def test_equal_within_margin_is_not_promoted(cand, ref, margin):
    d = promotion.decide(results(cand), BASE, latest_of(ref), margin=margin)
    assert not d.promote, d.reason


def test_float_noise_does_not_promote():
    d = promotion.decide(results(0.1 + 0.2), BASE, latest_of(0.3), margin=0.0)  # 0.30000000000000004
    assert not d.promote


def test_no_previous_latest_compares_with_base():
    assert promotion.decide(results(0.30), BASE, None, margin=0.0).promote
    d = promotion.decide(results(0.25), BASE, None, margin=0.0)
    assert not d.promote and d.reference == "base" and "base model" in d.reason


def test_incomparable_evaluations_are_not_promoted():
    d = promotion.decide(results(0.9, eval_sha="f" * 64), BASE, None, margin=0.0)
    assert not d.promote and "evaluation sets differ" in d.reason
    d = promotion.decide(results(0.9, temperature=0.6), BASE, latest_of(0.1), margin=0.0)
    assert not d.promote and "temperature" in d.reason


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), float("-inf")])
def test_non_finite_scores_never_promote_nor_reach_the_pointer(bad):
    with pytest.raises(UserError, match="not a finite score"):
        promotion.check_results(results(bad), "--eval-results")


def test_results_without_scores_are_rejected():
    with pytest.raises(UserError, match="overall.avg@k"):
        promotion.check_results({"overall": {}}, "--eval-results")
    bad = results(0.5)
    bad["overall"]["samples_scored"] = 0
    with pytest.raises(UserError, match="no samples were scored"):
        promotion.check_results(bad, "--eval-results")


def _publish(store, exp_uri, tmp_path, version, exported_at):
    src = tmp_path / "src" / version
    src.mkdir(parents=True)
    (src / "export.json").write_text(json.dumps({"version": version, "exported_at": exported_at}))
    (src / "model.safetensors").write_bytes(version.encode())
    store.upload_dir(str(src), f"{exp_uri}/{version}")


def test_latest_pointer_and_retention_never_delete_latest(tmp_path):
    root = f"file://{tmp_path / 'store'}"
    store = open_store(root)
    exp_uri = promotion.experiment_uri(root, "exp1")
    assert promotion.read_latest(store, exp_uri) is None
    for i in range(1, 6):
        _publish(store, exp_uri, tmp_path, f"v{i}", f"2026-01-0{i}T00:00:00+00:00")
    decision, pointer = promotion.promote(
        store,
        exp_uri,
        "v1",
        f"{exp_uri}/v1",
        results(0.9),
        "2026-01-01T00:00:00+00:00",
        lambda current: promotion.decide(results(0.9), BASE, current, 0.0),
    )
    assert decision.promote and pointer["seq"] == 1
    assert promotion.read_latest(store, exp_uri)["version"] == "v1"
    deleted = promotion.prune(store, exp_uri, keep=2)
    assert sorted(deleted) == ["v2", "v3"]  # v5, v4 are the newest two; v1 is the latest
    left = sorted(u.rsplit("/", 1)[-1] for u in store.list_versions(exp_uri))
    assert left == ["v1", "v4", "v5"]
    assert store.read_manifest(f"{exp_uri}/v1") is not None
    assert promotion.prune(store, exp_uri, keep=2) == []  # idempotent


def test_corrupt_latest_pointer_is_a_clear_error(tmp_path):
    root = f"file://{tmp_path / 'store'}"
    store = open_store(root)
    exp_uri = promotion.experiment_uri(root, "exp1")
    store.write_bytes(f"{exp_uri}/latest.json", b"{not json")
    with pytest.raises(UserError, match="latest.json: not valid JSON"):
        promotion.read_latest(store, exp_uri)
