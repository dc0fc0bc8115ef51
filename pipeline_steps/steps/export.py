"""Step ``export``: merge a verl FSDP checkpoint into a Hugging Face model, check it, document it,
upload it and decide whether it becomes the experiment's ``latest``.

Flow (every output location derives from the inputs, so a retry gives the same result):

1. resolve ``RUN/checkpoints`` (+ ``--step``) to ``global_step_N/actor`` and check the layout;
2. merge the actor shards with verl's own merger (``verl.model_merger``, FSDP backend,
   in-process) into ``OUTPUT/model`` (atomic); the merged weights are bf16, as verl writes them;
3. load the merged model with transformers and generate a few tokens;
4. decide promotion (:mod:`pipeline_steps.evaluation.promotion`) against the current ``latest.json``
   (or the base model's evaluation when there is none);
5. write the model card (:mod:`pipeline_steps.evaluation.model_card`) and ``export.json``, upload the
   directory to ``<store-root>/models/exported/<experiment>/<version>/`` (the store writes
   the checksum manifest last), then move ``latest.json`` if promoted and prune old versions.

The version is ``step<N>-<first 12 hex of the weights' sha256>``: the same checkpoint always
exports to the same version, so a retry re-uses what is already uploaded.

The Hub push (``--hub-repo``) runs only when a token is in the environment (``HF_TOKEN``,
from the Airflow connection); it is off by default and untested here (no Hub access).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import re
from pathlib import Path

from pipeline_steps import atomic, outputs, tracking_run
from pipeline_steps.errors import UserError
from pipeline_steps.planning.layout import RunLayout
from pipeline_steps.training.checkpoints import (
    check_model,
    dir_sha256,
    merge_checkpoint,
    resolve_checkpoint,
    weights_sha256,
)

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


# ---------------------------------------------------------------------------------------------
# the step


def add_arguments(p):
    p.add_argument(
        "--checkpoint-dir",
        required=True,
        help="the run's checkpoints directory (holds latest_checkpointed_iteration.txt)",
    )
    p.add_argument("--step", type=int, help="export global_step_N instead of the latest")
    p.add_argument("--output", required=True, help="local directory for the merged model and card")
    p.add_argument(
        "--store-root", required=True, help="store root URI (file:///..., oss://bucket/prefix, gs://bucket/prefix)"
    )
    p.add_argument("--experiment", required=True, help="experiment name (the export location's folder)")
    p.add_argument(
        "--lineage", required=True, help="lineage JSON written by the DAG (see pipeline_steps.evaluation.model_card)"
    )
    p.add_argument("--eval-results", required=True, help="results.json of the checkpoint from the evaluate step")
    p.add_argument("--base-results", required=True, help="results.json of the base model from the evaluate step")
    p.add_argument("--margin", type=float, default=0.0, help="avg@k must beat the reference by more than this")
    p.add_argument(
        "--collapse-margin",
        type=float,
        default=None,
        help="avg@k must beat the best constant answer by more than this (default 0.05)",
    )
    p.add_argument(
        "--no-collapse-check",
        action="store_true",
        help="promote without the collapse check (best constant answer, non-modal accuracy vs the base)",
    )
    p.add_argument("--keep", type=int, default=5, help="exported versions to keep (the latest is never deleted)")
    p.add_argument("--fail-on-no-promotion", action="store_true", help="exit 2 when the model is not promoted")
    p.add_argument("--hub-repo", help="also push to this Hugging Face Hub repo (needs HF_TOKEN in the environment)")


def _load_json(path: str, what: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--{what} {p}: file not found; pass the file the previous step wrote")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UserError(
            f"--{what} {p}: not valid JSON ({str(exc).splitlines()[0]}); re-run the step that writes it"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"--{what} {p}: must be a JSON object")
    return data


def run(args) -> dict:
    from pipeline_steps.evaluation import model_card, promotion
    from pipeline_steps.store import open_store

    if not NAME_RE.match(args.experiment):
        raise UserError(
            f"--experiment {args.experiment!r}: use letters, digits, '_', '.', '-' (it names a storage folder)"
        )
    if args.keep < 1:
        raise UserError(f"--keep {args.keep}: must be at least 1")
    if args.margin < 0:
        raise UserError(f"--margin {args.margin}: must be >= 0")
    cm = promotion.COLLAPSE_MARGIN if args.collapse_margin is None else args.collapse_margin
    if not 0 <= cm < 1:
        raise UserError(f"--collapse-margin {cm}: must be in [0, 1)")
    gate = {"collapse_margin": cm, "collapse_check": not args.no_collapse_check}
    lineage = _load_json(args.lineage, "lineage")
    results = promotion.check_results(_load_json(args.eval_results, "eval-results"), "--eval-results")
    base = promotion.check_results(_load_json(args.base_results, "base-results"), "--base-results")
    step, actor = resolve_checkpoint(args.checkpoint_dir, args.step)

    out = Path(args.output)
    outputs.refuse_overlap(
        out,
        {
            "--checkpoint-dir": args.checkpoint_dir,
            "--eval-results": args.eval_results,
            "--base-results": args.base_results,
            "--lineage": args.lineage,
        },
    )
    outputs.check_reusable(out, "export")
    out.mkdir(parents=True, exist_ok=True)
    outputs.mark(out, "export")
    model_dir = out / "model"
    merge_checkpoint(actor, model_dir)
    merged_sha = dir_sha256(model_dir)  # what evaluate hashed when it merged the same checkpoint
    scored_sha = (results.get("model") or {}).get("content_sha256")
    if scored_sha and scored_sha != merged_sha:
        raise UserError(
            f"--eval-results {args.eval_results}: scored a different model (content sha256 {scored_sha[:12]}) than "
            f"global_step_{step} ({merged_sha[:12]}); run evaluate on the same checkpoint and step, nothing was "
            "exported"
        )
    check = check_model(model_dir)
    weights = weights_sha256(model_dir)
    version = f"step{step}-{weights[:12]}"

    store = open_store(args.store_root)
    exp_uri = promotion.experiment_uri(args.store_root, args.experiment)
    version_uri = f"{exp_uri}/{version}"
    previous = None  # the record of an earlier, complete export of this very version (a retry)
    if store.read_manifest(version_uri) is not None:
        with contextlib.suppress(TypeError, ValueError):
            previous = json.loads(store.read_bytes(f"{version_uri}/export.json"))
    exported_at = (previous or {}).get("exported_at") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")

    latest = promotion.read_latest(store, exp_uri)
    if latest and latest.get("version") == version:  # a retry after promotion: keep the recorded decision
        recorded = (previous or {}).get("promotion") or {}
        decision = promotion.Decision(
            True,
            recorded.get("reason") or f"{version} is already the latest",
            recorded.get("reference") or "latest",
            recorded.get("reference_score"),
        )
    else:
        decision = promotion.decide(results, base, latest, args.margin, **gate)
    record = {
        "version": version,
        "experiment": args.experiment,
        "exported_at": exported_at,
        "checkpoint": {"dir": str(Path(args.checkpoint_dir).resolve()), "step": step},
        "weights_sha256": weights,
        "check": check,
        "eval": promotion.summary_of(results),
        "base_eval": promotion.summary_of(base),
        "promotion": decision.as_dict(),
        "lineage": lineage,
        # the training's MLflow run, recorded beside its checkpoints (by the CPU trainer or the cluster entrypoint)
        "mlflow": tracking_run.read(RunLayout.for_checkpoints(args.checkpoint_dir).mlflow_record),
    }
    atomic.write_text(model_dir / "README.md", model_card.render(record, results, base))
    atomic.write_json(model_dir / "export.json", record)
    # replace: the version's card and export.json are rewritten by a retry or after a lost promotion race
    upload = store.upload_dir(str(model_dir), version_uri, replace=True)

    if decision.promote:  # the pointer moves only with the store's conditional create (concurrent exports)
        final, _ = promotion.promote(
            store,
            exp_uri,
            version,
            version_uri,
            results,
            exported_at,
            lambda current: promotion.decide(results, base, current, args.margin, **gate),
            ensure_present=lambda: store.upload_dir(str(model_dir), version_uri, replace=True),  # pruned meanwhile
        )
        if final.promote != decision.promote:  # lost a race to a better model: the card must say so
            log.info("export %s: %s", version, final.reason)
            decision = final
            record["promotion"] = decision.as_dict()
            atomic.write_text(model_dir / "README.md", model_card.render(record, results, base))
            atomic.write_json(model_dir / "export.json", record)
            upload = store.upload_dir(str(model_dir), version_uri, replace=True)  # re-sends the two small files
    deleted = promotion.prune(store, exp_uri, args.keep)

    if record["mlflow"]:  # the evaluation and the card join the training's metrics in the same MLflow run
        metrics = tracking_run.numeric(promotion.summary_of(results), "eval/")
        metrics |= tracking_run.numeric(promotion.summary_of(base), "eval_base/")
        metrics["export/promoted"] = float(decision.promote)
        tracking_run.log_to_run(record["mlflow"], metrics, [model_dir / "README.md", model_dir / "export.json"], step)
    hub = None
    if args.hub_repo:
        hub = push_to_hub(model_dir, args.hub_repo)
    summary = {
        "uri": version_uri,
        "version": version,
        "step": step,
        "local_path": str(model_dir),
        "promoted": decision.promote,
        "reason": decision.reason,
        "avg@k": results["overall"]["avg@k"],
        "reference": decision.reference,
        "reference_avg@k": decision.reference_score,
        "uploaded": upload.get("uploaded"),
        "skipped_files": upload.get("skipped"),
        "deleted_versions": deleted,
        "hub": hub,
        "mlflow": record["mlflow"],
        "table": model_card.eval_table(results, base),
    }
    log.info("exported %s to %s; %s", version, version_uri, decision.reason)
    if not decision.promote and args.fail_on_no_promotion:
        raise UserError(f"{version} uploaded to {version_uri} but not promoted: {decision.reason}")
    return summary


def push_to_hub(model_dir: Path, repo_id: str) -> dict:
    """Optional Hub push; needs HF_TOKEN (from the Airflow connection via the environment). Untested here."""
    token = os.environ.get("HF_TOKEN")
    if not token:
        raise UserError(
            f"--hub-repo {repo_id}: no HF_TOKEN in the environment; configure the Hugging Face connection or drop "
            "--hub-repo"
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=True, exist_ok=True)
        info = api.upload_folder(folder_path=str(model_dir), repo_id=repo_id, repo_type="model")
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        raise UserError(
            f"--hub-repo {repo_id}: the Hub refused the upload (HTTP {status}); check the token's write access"
        ) from None
    return {"repo": repo_id, "commit": getattr(info, "oid", None)}
