"""Writers racing on one store location, on every backend (file://, the OSS and GCS test servers), released together
by a barrier and repeated so that the interleavings the old code got wrong come up.

Before: two uploads of different content to one version both reported success, the manifest of one and objects of
the other, and the version was refused on download.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from pipeline_steps.errors import UserError
from pipeline_steps.store import open_store
from tests.storage_servers import run_step
from tests.test_store_backends import backend  # noqa: F401  (the file/oss/gs fixture)

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
            wrong.append(f"round {r}: the version is refused on download ({str(exc)[:120]})")
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
