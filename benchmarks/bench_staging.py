"""Stage a synthetic multi-GB Hub model into a file:// store: streamed staging against the baseline, side by side.

    make bench BENCH=staging                      # 2 GiB model: 5 random shards + small files
    BENCH_STAGING_MB=512 make bench BENCH=staging

The Hub is the local stand-in the tests use too (pipeline_steps/local/hub_stand_in.py, serving files from disk)
with ``HF_ENDPOINT`` pointed at it. Cases, each in its own child process (peak RSS from its own ``getrusage``):

- ``baseline``: ``huggingface_hub.snapshot_download`` (``local_dir``) into an empty directory, then
  ``Store.upload_dir`` (the old step: the whole model on local disk first);
- ``streamed``: ``stage-model``'s streamed path (data/hub_stream.py): one file at a time.

Peak local disk is sampled every 20 ms by the parent (du of the Hub cache / the scratch dir). Target: streamed peak
disk <= largest file + margin, throughput >= 0.8x the baseline's. Server and client share the 2 cores.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO = "bench/model"


def _child(case: str, dest: str) -> None:
    t0 = time.perf_counter()
    from pipeline_steps.store import open_store

    store = open_store(dest)
    if case == "baseline":
        from huggingface_hub import snapshot_download

        # local_dir: real files (the cache's snapshot dir holds symlinks into blobs/, which upload_dir refuses)
        snap = snapshot_download(REPO, revision="main", local_dir=os.environ["TMPDIR"] + "/snap")
        sent = store.upload_dir(snap, f"{dest}/models/{REPO}/baseline")["bytes_uploaded"]
    else:
        from pipeline_steps.data import hub_stream

        commit, files = hub_stream.hub_files(REPO, "main")
        sent = hub_stream.stage(store, REPO, commit, files, f"{dest}/models/{REPO}/{commit}")["bytes_uploaded"]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": time.perf_counter() - t0, "rss_mb": usage.ru_maxrss / 1024, "sent": sent}))


def _du(path: Path) -> int:
    n = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                n += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return n


def _run(case: str, tmp: Path, url: str) -> dict:
    watch = tmp / f"local-{case}"
    watch.mkdir()
    dest = tmp / f"store-{case}"
    env = {
        **os.environ,
        "HF_ENDPOINT": url,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_CACHE": str(watch / "hub"),
        "TMPDIR": str(watch),
        "PIPELINE_CACHE_DIR": str(tmp / f"cache-{case}"),
    }
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], _du(watch))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_staging", "--child", case, f"file://{dest}"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
    finally:
        done.set()
        t.join()
    if r.returncode != 0:
        raise RuntimeError(f"{case} failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    shutil.rmtree(watch, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)  # the next case needs the disk
    return {**out, "peak_disk_mb": peak[0] / (1 << 20)}


def main() -> None:
    total_mb = int(os.environ.get("BENCH_STAGING_MB", "2048"))
    from pipeline_steps.data.hub_stream import MARGIN
    from pipeline_steps.local.hub_stand_in import HubStandIn

    with tempfile.TemporaryDirectory(prefix="bench-staging-") as tmp:
        tmp = Path(tmp)
        src = tmp / "hub-files"
        src.mkdir()
        shard_mb = total_mb // 5
        files: dict[str, bytes | Path] = {"config.json": b'{"model_type": "qwen2"}', "tokenizer.json": b"{}" * 5000}
        for i in range(5):
            p = src / f"model-{i + 1:05d}-of-00005.safetensors"
            with open(p, "wb") as f:  # incompressible
                for _ in range(shard_mb):
                    f.write(os.urandom(1 << 20))
            files[p.name] = p
        hub = HubStandIn(REPO, files)
        try:
            for name in files:
                hub._meta(name)
            rows = {case: _run(case, tmp, hub.url) for case in ("baseline", "streamed")}
        finally:
            hub.close()
    model_mb = shard_mb * 5
    print(f"\nstaging a {model_mb} MiB model (5 x {shard_mb} MiB shards) into file://; margin {MARGIN >> 20} MiB")
    hdr = f"{'case':9s} {'s':>7s} {'MB/s':>6s} {'RSS MB':>7s} {'peak disk MB':>13s} {'disk/model':>10s}"
    print(hdr)
    print("-" * len(hdr))
    for case, r in rows.items():
        print(
            f"{case:9s} {r['seconds']:7.2f} {model_mb / r['seconds']:6.0f} {r['rss_mb']:7.0f} {r['peak_disk_mb']:13.0f}"
            f" {r['peak_disk_mb'] / model_mb:10.2f}"
        )
    b, s = rows["baseline"], rows["streamed"]
    ok_disk = s["peak_disk_mb"] <= shard_mb + (MARGIN >> 20)
    ok_speed = b["seconds"] / s["seconds"] >= 0.8
    print(
        f"\nstreamed/baseline: throughput x{b['seconds'] / s['seconds']:.2f}, peak disk x"
        f"{s['peak_disk_mb'] / max(b['peak_disk_mb'], 1):.2f}, RSS x{s['rss_mb'] / b['rss_mb']:.2f}; targets: "
        f"disk <= largest file + margin {'met' if ok_disk else 'MISSED'}, throughput >= 0.8x "
        f"{'met' if ok_speed else 'MISSED'}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:4])
    else:
        main()
