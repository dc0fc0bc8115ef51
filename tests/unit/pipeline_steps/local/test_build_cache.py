"""A cached model build runs once however many runs ask for it at the same time (a backfill of four runs on a fresh
machine built the tiny model four times at once on two cores: 23 minutes of ``stage_model`` each)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from pipeline_steps.local.build_cache import cached_build


def _slow_build(path: Path) -> None:
    path.mkdir(parents=True)
    with open(path.parent.parent / "builds.log", "a") as f:  # beside the cache entry, outside the build's dir
        f.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    (path / "tokenizer.json").write_text("{}")
    (path / "config.json").write_text("{}")


def _ask(cache: str, out: str) -> None:
    entry = cached_build(Path(cache) / "digest", _slow_build, Path(out) / "fallback", "test model")
    Path(out, f"{os.getpid()}.result").write_text(str(entry))


def test_concurrent_builders_build_once_and_all_get_the_entry(tmp_path):
    cache = tmp_path / "cache" / "tiny-model"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ask, args=(str(cache), str(tmp_path))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    builds = (cache / "builds.log").read_text().split()
    assert len(builds) == 1, builds  # without the lock: 4
    results = {p.read_text() for p in tmp_path.glob("*.result")}
    assert results == {str(cache / "digest")}
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]  # no half-built leftovers


def test_an_unwritable_cache_builds_in_the_fallback(tmp_path):
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o500)
    try:
        if os.access(cache, os.W_OK):  # root ignores the mode: make the parent a file instead
            cache = tmp_path / "a-file"
            cache.write_text("")
        got = cached_build(cache / "tiny-model" / "digest", _slow_build_here, tmp_path / "fb" / "m", "test model")
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert got == tmp_path / "fb" / "m" and (got / "config.json").exists()


def _slow_build_here(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text("{}")
    (path / "config.json").write_text("{}")
