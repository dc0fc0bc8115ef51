"""Promotion gate and retention for exported models.

Layout under the store root::

    models/exported/<experiment>/<version>/...      one exported model (manifest-committed)
    models/exported/<experiment>/latest.json        pointer to the promoted version

A candidate becomes ``latest`` only if its avg@k beats the reference by MORE than the
margin, where the reference is the current latest, or the base model when there is no
latest yet. Scores are only compared when they come from the same evaluation set and the
same sampling settings; otherwise the candidate stays a candidate and the reason says so.
Retention keeps the newest ``keep`` versions (by export time) and never deletes the latest, nor a version being
promoted (``prune`` and ``promote`` meet over markers, see ``_guard``).

Before any of that, the collapse check (on unless ``collapse_check=False``): a model that learned only the prior
(GRPO on skewed answers collapsing to the most common one, a hacked reward) can beat its base on avg@k. It is refused
when its avg@k does not beat the best constant answer (the share of the most common ground truth) by more than
``collapse_margin``, or when its avg@k on the problems whose answer is not that one is not above the base model's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Callable

from pipeline_steps.errors import TransientError, UserError
from pipeline_steps.evaluation.metrics import figures_of

log = logging.getLogger(__name__)

EPS = 1e-12  # scores equal up to float noise count as equal (not promoted at margin 0)
COMPARED = ("k", "temperature", "top_p", "max_new_tokens", "max_problems")
COLLAPSE_MARGIN = 0.05  # avg@k must beat the best constant answer by more than this (points of accuracy / 100)
FIGURES = ("best_constant", "non_modal_avg@k", "majority_distinct", "majority_top_share", "ground_truth_top_share")


@dataclasses.dataclass
class Decision:
    promote: bool
    reason: str
    reference: str  # "latest", "base" or "none"
    reference_score: float | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def experiment_uri(store_root: str, experiment: str) -> str:
    return f"{store_root.rstrip('/')}/models/exported/{experiment}"


def check_results(res: dict, what: str) -> dict:
    """Validate an evaluate ``results.json`` enough to compare it; UserError otherwise."""
    overall = res.get("overall") if isinstance(res, dict) else None
    if not isinstance(overall, dict) or not isinstance(overall.get("avg@k"), (int, float)):
        raise UserError(f"{what}: no overall.avg@k; pass a results.json written by the evaluate step")
    if not math.isfinite(overall["avg@k"]):  # Infinity/NaN would promote anything and poison the pointer
        raise UserError(f"{what}: overall.avg@k is {overall['avg@k']}, not a finite score; re-run evaluate")
    if not isinstance(overall.get("problems"), int) or overall["problems"] < 1:
        raise UserError(f"{what}: no overall.problems count; pass a results.json written by the evaluate step")
    if int(overall.get("samples_scored") or 0) < 1 or int(overall.get("k") or 0) < 1:
        raise UserError(
            f"{what}: no samples were scored (k={overall.get('k')}); re-run evaluate with --k >= 1 on a non-empty set"
        )
    return res


def summary_of(res: dict) -> dict:
    o = res["overall"]
    return {
        "avg@k": o["avg@k"],
        "pass@k": o.get("pass@k"),
        "maj@k": o.get("maj@k"),
        "k": o.get("k"),
        "problems": o.get("problems"),
        "samples_scored": o.get("samples_scored"),
        "eval_set_sha256": (res.get("eval_set") or {}).get("sha256"),
        "sampling": res.get("sampling"),
        "model_sha256": (res.get("model") or {}).get("content_sha256"),
        **{f: (figures_of(res) or {}).get(f) for f in FIGURES},
    }


def collapse(results: dict, base: dict, margin: float = COLLAPSE_MARGIN) -> str | None:
    """Why the candidate looks like it learned only the prior (one line naming the figure), or None."""
    cand, ref = figures_of(results), figures_of(base)
    if cand is None or ref is None:
        which = "--eval-results" if cand is None else "--base-results"
        return f"collapse check impossible: {which} has no per-problem answers; re-run evaluate"
    score, const = float(results["overall"]["avg@k"]), float(cand["best_constant"])
    if not score > const + margin + EPS:
        return (
            f"collapse: avg@k {score:.4f} does not beat the best constant answer "
            f"({cand['modal_ground_truth']!r} every time: {const:.4f}) by more than {margin:.4f}"
        )
    mine, theirs = cand.get("non_modal_avg@k"), ref.get("non_modal_avg@k")
    if mine is not None and theirs is not None and not mine > theirs + EPS:
        return (
            f"collapse: avg@k on the {cand['non_modal_problems']} problems whose answer is not the most common one "
            f"({cand['modal_ground_truth']!r}) is {mine:.4f}, not above the base model's {theirs:.4f}"
        )
    return None


def _comparable(a: dict, b: dict) -> str | None:
    """Why two evaluations cannot be compared, or None when they can."""
    sa, sb = a.get("eval_set_sha256"), b.get("eval_set_sha256")
    if sa and sb and sa != sb:
        return f"evaluation sets differ ({sa[:12]} vs {sb[:12]})"
    pa, pb = a.get("sampling") or {}, b.get("sampling") or {}
    diff = [k for k in COMPARED if k in pa and k in pb and pa[k] != pb[k]]
    if diff:
        return "sampling settings differ (" + ", ".join(f"{k}: {pa[k]} vs {pb[k]}" for k in diff) + ")"
    return None


def decide(
    results: dict,
    base: dict,
    latest: dict | None,
    margin: float,
    collapse_margin: float = COLLAPSE_MARGIN,
    collapse_check: bool = True,
) -> Decision:
    cand = summary_of(results)
    why = collapse(results, base, collapse_margin) if collapse_check else None
    if why:
        return Decision(False, f"not promoted: {why}", "base", summary_of(base).get("avg@k"))
    score = float(cand["avg@k"])
    if latest is not None:
        ref_name, ref = f"latest {latest.get('version')}", latest
    else:
        ref_name, ref = "base model", summary_of(base)
    why = _comparable(cand, ref)
    if why:
        return Decision(
            False,
            f"not promoted: cannot compare with the {ref_name}: {why}; re-evaluate with the same settings",
            "latest" if latest else "base",
            ref.get("avg@k"),
        )
    ref_score = float(ref["avg@k"])
    diff = score - ref_score
    kind = "latest" if latest else "base"
    if diff > margin + EPS:
        return Decision(
            True,
            f"promoted: avg@k {score:.4f} beats the {ref_name} ({ref_score:.4f}) by {diff:+.4f} > margin {margin:.4f}",
            kind,
            ref_score,
        )
    return Decision(
        False,
        f"not promoted: avg@k {score:.4f} vs the {ref_name} ({ref_score:.4f}) is {diff:+.4f}, "
        f"not more than margin {margin:.4f}; it stays a candidate",
        kind,
        ref_score,
    )


def _missing(exc: Exception) -> bool:
    return (
        isinstance(exc, (FileNotFoundError, KeyError))
        or "not found" in str(exc).lower()
        or "no such" in str(exc).lower()
    )


POINTERS = "latest"  # <exp>/latest/<seq>.json: one immutable record per promotion, created exclusively


def _records(store, exp_uri: str) -> list[int]:
    names = store.list_names(f"{exp_uri}/{POINTERS}")
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _parse_pointer(data: bytes, where: str) -> dict | None:
    try:
        latest = json.loads(data)
    except ValueError:
        raise UserError(f"{where}: not valid JSON; fix or delete it (the next promotion rewrites it)") from None
    return latest if isinstance(latest, dict) and latest.get("version") else None


def newest(store, exp_uri: str) -> tuple[int, dict | None]:
    """(sequence number, pointer) of the current latest model: the newest promotion record. Stores promoted
    before records existed have only ``latest.json``, read as record 0."""
    seqs = _records(store, exp_uri)
    if seqs:
        where = f"{exp_uri}/{POINTERS}/{seqs[-1]:08d}.json"
        return seqs[-1], _parse_pointer(store.read_bytes(where) or b"null", where)
    try:
        data = store.read_bytes(f"{exp_uri}/latest.json")
    except Exception as exc:
        if _missing(exc):
            return 0, None
        raise
    return 0, (_parse_pointer(data, f"{exp_uri}/latest.json") if data is not None else None)


def read_latest(store, exp_uri: str) -> dict | None:
    return newest(store, exp_uri)[1]


# Prune and promotion meet over two markers, a handshake in which each side writes before it reads (strongly
# consistent stores: file://, OSS, GCS), so at least one sees the other: a promotion writes promoting/<v>/<id>.json,
# then waits while pruning/<v>.json exists; a prune creates pruning/<v>.json, then spares v if it is the latest or
# anything is under promoting/<v>/. Hence no prune deletes v once a promotion of v has seen no prune of it.
PROMOTING, PRUNING = "promoting", "pruning"
PRUNE_WAIT = 60.0  # seconds a promotion waits for another export's prune of its version to finish


def _guard(store, exp_uri: str, version: str, version_uri: str, ensure_present: Callable[[], object] | None) -> None:
    """Once our promoting marker is written: wait out a prune of ``version``, then make sure it is fully present."""
    tomb = f"{exp_uri}/{PRUNING}/{version}.json"
    deadline = time.monotonic() + PRUNE_WAIT
    while store.read_bytes(tomb) is not None:
        if time.monotonic() > deadline:
            raise TransientError(
                f"{version_uri}: another export's retention holds {tomb} for over {PRUNE_WAIT:.0f} s; retried "
                "(delete that file if no export is running)"
            )
        time.sleep(0.2)
    for again in (True, False):
        manifest, problems = store.verify(version_uri)
        if manifest is not None and not problems:
            return
        if not again or ensure_present is None:
            why = "; ".join(problems)[:200]
            raise TransientError(f"{version_uri}: not fully present ({why}); not promoted, retried")
        log.warning("%s was deleted or damaged before its promotion (%s); uploading it again", version_uri, problems)
        ensure_present()


def promote(
    store,
    exp_uri: str,
    version: str,
    version_uri: str,
    results: dict,
    exported_at: str,
    decide_against: Callable[[dict | None], Decision],
    attempts: int = 20,
    ensure_present: Callable[[], object] | None = None,
) -> tuple[Decision, dict | None]:
    """Make ``version`` the latest if ``decide_against(current latest)`` says so, safely against concurrent exports.

    The pointer is the newest record ``latest/<seq>.json``; a promotion creates record ``seq + 1`` with the store's
    conditional create, so of two exports promoting at the same moment exactly one wins. The loser re-reads the
    (new) latest and decides again against it. ``latest.json`` mirrors the newest record for people and old readers.
    A record is only created for a version that is fully present and that no prune can delete meanwhile
    (``_guard``); ``ensure_present`` uploads the version again if a prune took it first.

    :returns: (the final decision, the pointer written or None).
    """
    intent = f"{exp_uri}/{PROMOTING}/{version}/{uuid.uuid4().hex}.json"  # one per promotion: two may share a version
    guarded = False
    try:
        for _ in range(attempts):
            seq, current = newest(store, exp_uri)
            if current and current.get("version") == version:  # a retry after this version was promoted
                return Decision(True, f"{version} is already the latest", "latest", current.get("avg@k")), current
            decision = decide_against(current)
            if not decision.promote:
                return decision, None
            if not guarded:  # first the marker (the write), then the look for a prune (the read)
                store.write_bytes(intent, (json.dumps({"version": version}) + "\n").encode())
                guarded = True
                _guard(store, exp_uri, version, version_uri, ensure_present)
            pointer = {"version": version, "uri": version_uri, "exported_at": exported_at, "seq": seq + 1}
            pointer.update(summary_of(results))
            body = (json.dumps(pointer, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
            if store.create_bytes(f"{exp_uri}/{POINTERS}/{seq + 1:08d}.json", body):
                _mirror(store, exp_uri)
                return decision, pointer
            log.info("another export promoted at the same moment; re-reading the latest and deciding again")
        raise RuntimeError(f"{exp_uri}: promotion lost {attempts} races in a row; retry the export")
    finally:
        if guarded:  # recorded as the latest (prune spares it) or not promoted: the marker has done its work
            store.delete(intent)


def _mirror(store, exp_uri: str) -> None:
    """``latest.json`` = the newest record (re-checked after writing, so a slower writer cannot leave it stale)."""
    for _ in range(5):
        seq, current = newest(store, exp_uri)
        body = (json.dumps(current, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
        store.write_bytes(f"{exp_uri}/latest.json", body)
        if newest(store, exp_uri)[0] == seq:
            return


def _exported_at(store, exp_uri: str, version: str) -> str:
    try:
        return json.loads(store.read_bytes(f"{exp_uri}/{version}/export.json")).get("exported_at") or ""
    except Exception:  # an old or foreign version without export.json sorts first (oldest)
        return ""


def prune(store, exp_uri: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` versions; never the latest. Returns deleted version names."""
    if keep < 1:
        raise UserError(f"--keep {keep}: must be at least 1")
    versions = [v.rstrip("/").rsplit("/", 1)[-1] for v in store.list_versions(exp_uri)]
    latest = read_latest(store, exp_uri)
    protected = {latest["version"]} if latest else set()
    ordered = sorted(versions, key=lambda v: (_exported_at(store, exp_uri, v), v), reverse=True)
    deleted = []
    for v in (v for v in ordered[keep:] if v not in protected):
        tomb = f"{exp_uri}/{PRUNING}/{v}.json"
        if not store.create_bytes(tomb, (json.dumps({"version": v}) + "\n").encode()):
            continue  # another export's prune is on it
        try:  # first the marker (the write), then the look for a promotion of v (the read)
            latest = read_latest(store, exp_uri)
            if (latest and latest.get("version") == v) or store.list_names(f"{exp_uri}/{PROMOTING}/{v}"):
                log.info("retention: kept %s/%s (being promoted or the latest)", exp_uri, v)
                continue
            store.delete_prefix(f"{exp_uri}/{v}")
        finally:
            store.delete(tomb)
        deleted.append(v)
        log.info("retention: deleted %s/%s (keeping %d)", exp_uri, v, keep)
    return deleted
