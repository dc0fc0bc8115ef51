"""Writers racing on one store location, on every backend (file://, the OSS and GCS test servers), released together
by a barrier and repeated so that the interleavings the old code got wrong come up.

Before: two uploads of different content to one version both reported success, the manifest of one and objects of
the other, and the version was refused on download; one export's retention prune could delete the version another
export was promoting, leaving ``latest`` on a deleted version.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest

from pipeline_steps.errors import TransientError, UserError
from pipeline_steps.store import open_store
from tests.helpers.storage_servers import run_step

ROUNDS = 6


def _tree(root: Path, seed: int) -> Path:
    rnd = random.Random(seed)
    root.mkdir(parents=True)
    for i in range(6):
        (root / f"part-{i}.bin").write_bytes(rnd.randbytes(40_000 + 1000 * i))
    return root


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _together(root_uri: str, jobs: list) -> list:
    """Run ``job(store)`` for each job in its own thread with its own client, started by one barrier: results or
    the exceptions raised."""
    barrier = threading.Barrier(len(jobs))
    out: list = [None] * len(jobs)

    def run(i: int) -> None:
        store = open_store(root_uri)
        barrier.wait()
        try:
            out[i] = jobs[i](store)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def _upload_race(backend, tmp_path, seeds: list[int]) -> list[str]:  # noqa: F811
    """Uploads of trees made from ``seeds`` race for one version, ROUNDS times; what went wrong in each round."""
    wrong = []
    for r in range(ROUNDS):
        srcs = [_tree(tmp_path / f"r{r}" / f"src{i}", s) for i, s in enumerate(seeds)]
        dest = f"{backend.root_uri}/datasets/race/r{r}"
        outcomes = _together(backend.root_uri, [lambda st, s=s: st.upload_dir(s, dest) for s in srcs])
        try:
            got = _files(Path(open_store(backend.root_uri).download_dir(dest, tmp_path / f"r{r}" / "out")["path"]))
        except Exception as exc:  # noqa: BLE001
            said = "; ".join(
                f"seed {seed}: {o if isinstance(o, dict) else repr(o)[:300]}" for seed, o in zip(seeds, outcomes)
            )
            wrong.append(f"round {r}: the version is refused on download ({str(exc)[:120]}); the writers: {said}")
            continue
        for src, seed, outcome in zip(srcs, seeds, outcomes):
            if _files(src) == got:  # the committed content, or the same content: success
                if not isinstance(outcome, dict):
                    wrong.append(f"round {r}: a writer of the committed content failed: {outcome!r}")
            elif isinstance(outcome, dict):
                wrong.append(f"round {r}: writer of seed {seed} reported success but its content is not the version")
            elif not (isinstance(outcome, UserError) and dest in str(outcome) and "new version" in str(outcome)):
                wrong.append(f"round {r}: the loser's error is not the one-line refusal: {outcome!r}")
            elif len(str(outcome).splitlines()) != 1:
                wrong.append(f"round {r}: the refusal is not one line")
        if not any(_files(src) == got for src in srcs):
            wrong.append(f"round {r}: the version holds no writer's content")
    return wrong


@pytest.mark.timeout(300)
def test_concurrent_uploads_of_different_content_leave_one_writers_version(backend, tmp_path):  # noqa: F811
    wrong = _upload_race(backend, tmp_path, [1, 2])
    assert not wrong, f"{len(wrong)} problems in {ROUNDS} rounds:\n" + "\n".join(wrong)


@pytest.mark.timeout(300)
def test_concurrent_uploads_of_the_same_content_all_succeed(backend, tmp_path):  # noqa: F811
    wrong = _upload_race(backend, tmp_path, [1, 1, 2])  # two writers of one content against a third
    assert not wrong, f"{len(wrong)} problems in {ROUNDS} rounds:\n" + "\n".join(wrong)


def test_upload_of_other_content_to_a_committed_version_is_refused(backend, tmp_path):  # noqa: F811
    dest = f"{backend.root_uri}/datasets/fixed/v1"
    one, two = _tree(tmp_path / "one", 1), _tree(tmp_path / "two", 2)
    assert run_step(["upload", "--src", str(one), "--dest", dest], backend.env).returncode == 0
    r = run_step(["upload", "--src", str(two), "--dest", dest], backend.env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and dest in lines[0] and "new version" in lines[0], r.stderr[-2000:]
    assert run_step(["upload", "--src", str(one), "--dest", dest], backend.env).returncode == 0  # same: idempotent
    store = open_store(backend.root_uri)
    assert store.verify(dest)[1] == [] and _files(Path(store.download_dir(dest, tmp_path / "out")["path"])) == _files(
        one
    )


def _promote(store, exp_uri: str, version: str, score: float, **kw):
    from pipeline_steps.evaluation import promotion
    from tests.helpers.eval_results import BASE, results

    decide = lambda c: promotion.decide(results(score), BASE, c, 0.0)  # noqa: E731
    return promotion.promote(
        store, exp_uri, version, f"{exp_uri}/{version}", results(score), "2026-01-02", decide, **kw
    )


def _publish(store, exp_uri: str, tmp_path: Path, version: str, exported_at: str) -> None:
    src = tmp_path / version
    src.mkdir(parents=True)
    (src / "export.json").write_text(json.dumps({"version": version, "exported_at": exported_at}))
    (src / "model.safetensors").write_bytes(version.encode() * 1000)
    store.upload_dir(str(src), f"{exp_uri}/{version}")


@pytest.mark.timeout(600)
# the default budget, stated: it weighs this module so make test-fast starts it early (36 s of waiting on the stores,
# its 15 tests about 60 s: the last module of the fast suite, 20 s after the other workers had finished)
@pytest.mark.budget(120)
def test_prune_never_deletes_the_version_another_export_promotes(backend, tmp_path):  # noqa: F811
    """Export A prunes (keep 1) while export B promotes ``cand``, an older export than A's ``new``: retention alone
    would delete ``cand``. B starts after a delay swept across the prune's duration, to meet every step of it."""
    from pipeline_steps.evaluation import promotion

    store = open_store(backend.root_uri)
    wrong, prune_took, rounds = [], 0.05, 3 * ROUNDS
    for r in range(rounds):
        exp_uri = f"{backend.root_uri}/models/exported/race{r}"
        for v, day in (("old", 1), ("cand", 2), ("new", 3)):
            _publish(store, exp_uri, tmp_path / f"r{r}", v, f"2026-01-0{day}T00:00:00+00:00")
        _promote(store, exp_uri, "old", 0.4)
        delay = prune_took * 1.2 * r / (rounds - 1)

        def prune(st):
            t0 = time.monotonic()
            out = promotion.prune(st, exp_uri, keep=1)
            return out, time.monotonic() - t0

        def promote(st):
            time.sleep(delay)
            return _promote(st, exp_uri, "cand", 0.6)

        pruned, promoted = _together(backend.root_uri, [prune, promote])
        if isinstance(pruned, tuple):
            prune_took = pruned[1]
        else:
            wrong.append(f"round {r}: prune failed: {pruned!r}")
        if not isinstance(promoted, (tuple, TransientError)):
            wrong.append(f"round {r}: promote failed: {promoted!r}")
        latest = promotion.read_latest(store, exp_uri)
        manifest, problems = store.verify(latest["uri"])
        if manifest is None or problems:
            wrong.append(f"round {r} (delay {delay:.3f} s): latest is {latest['version']}, not present: {problems}")
        if store.list_names(f"{exp_uri}/pruning") or store.list_versions(f"{exp_uri}/promoting"):
            wrong.append(f"round {r}: a marker was left behind")
    assert not wrong, f"{len(wrong)} problems in {rounds} rounds:\n" + "\n".join(wrong)


def test_export_uploads_its_version_again_when_a_prune_took_it_first(backend, tmp_path):  # noqa: F811
    """The promotion's check before its record: a version deleted by a prune is uploaded again, then promoted."""
    from pipeline_steps.evaluation import promotion

    store = open_store(backend.root_uri)
    exp_uri = f"{backend.root_uri}/models/exported/gone"
    _publish(store, exp_uri, tmp_path, "cand", "2026-01-02T00:00:00+00:00")
    store.delete_prefix(f"{exp_uri}/cand")
    again = lambda: store.upload_dir(str(tmp_path / "cand"), f"{exp_uri}/cand", replace=True)  # noqa: E731
    decision, pointer = _promote(store, exp_uri, "cand", 0.6, ensure_present=again)
    assert decision.promote and pointer["version"] == "cand" and store.verify(f"{exp_uri}/cand")[1] == []
    with pytest.raises(TransientError, match="not fully present"):  # without a way to upload it: not promoted
        _promote(store, exp_uri, "absent", 0.9)
    assert promotion.read_latest(store, exp_uri)["version"] == "cand"
