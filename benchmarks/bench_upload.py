"""Upload one large file through each store backend and the naive way, side by side.

    make bench BENCH=upload               # or: .venv/bin/python -m benchmarks.bench_upload
    BENCH_UPLOAD_MB=256 BENCH_BACKENDS=gs,oss/weed make bench BENCH=upload    # smaller, fewer rows

Servers are the test ones (pipeline_steps/local/object_store_stand_ins.py), started here and stopped at the end: the
OSS-dialect layer (pipeline_steps/local/oss_stand_in.py) over moto (``oss``) and over SeaweedFS (``oss/weed``), and
fake-gcs-server; ``file://`` is a local directory. Each backend first uploads 1 MiB, unmeasured (SeaweedFS grows
volumes on a bucket's first write). Every case runs in its own child process, which reports its own wall time and peak
RSS (``getrusage(RUSAGE_SELF).ru_maxrss``), so figures are per case. Cases:

- ``naive``: the seeds' way: read the whole file into memory, one ``put_object`` / ``upload_from_string`` /
  ``write`` (+ fsync, as durable as the store's copy);
- ``store``: ``open_store(uri).upload_dir`` (checksums, parallel multipart / chunked resumable, manifest);
- ``re-upload``: the same directory again (unchanged): time and bytes sent.

Targets (issue 3): store peak RSS <= parts in flight x part size + 100 MB; store throughput >= naive;
re-upload < 5% of the first upload's time with zero bytes sent. All servers are local and share the 2 cores
with the client, so absolute MB/s measure the servers as much as the client; the ratios are the point, and
two rows measure the emulators more than us: moto assembles a multipart upload in Python (several copies of
the object and its own checksum pass, under one lock), which is why ``oss/weed`` (same client, same layer,
a real S3 server in Go) is there; fake-gcs-server's cost per resumable chunk grows with the bytes already
received (16 MiB chunks: 256 MiB in 5.4 s, 1 GiB in 76 s), which the library's 100 MiB chunks keep small.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(case: str, backend: str, src: str, uri: str) -> None:
    t0 = time.perf_counter()
    sent = None
    if case == "naive":
        path = next(Path(src).iterdir())
        data = path.read_bytes()  # the whole file in memory
        if uri.startswith("oss://"):
            import alibabacloud_oss_v2 as oss

            cfg = oss.config.load_default()
            cfg.credentials_provider = oss.credentials.EnvironmentVariableCredentialsProvider()
            cfg.region, cfg.endpoint, cfg.use_path_style = os.environ["OSS_REGION"], os.environ["OSS_ENDPOINT"], True
            cfg.readwrite_timeout = 600
            bucket, _, key = uri[len("oss://") :].partition("/")
            oss.Client(cfg).put_object(oss.PutObjectRequest(bucket=bucket, key=f"{key}/{path.name}", body=data))
        elif uri.startswith("gs://"):
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            bucket, _, key = uri[len("gs://") :].partition("/")
            b = storage.Client(project="bench", credentials=AnonymousCredentials()).bucket(bucket)
            b.blob(f"{key}/{path.name}").upload_from_string(data, timeout=600)
        elif uri.startswith("file://"):
            out = Path(uri[len("file://") :]) / path.name
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "wb") as f:  # as durable as the store's copy (and as an acknowledged cloud put)
                f.write(data)
                os.fsync(f.fileno())
        else:
            raise ValueError(f"{backend}: no naive upload for {uri}")
        sent = len(data)
    else:
        from pipeline_steps.store import open_store

        sent = open_store(uri).upload_dir(src, uri)["bytes_uploaded"]
    elapsed = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "rss_mb": usage.ru_maxrss / 1024,  # Linux: KiB
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "sent": sent,
            }
        )
    )


def _run(case: str, backend: str, src: Path, uri: str, env: dict) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_upload", "--child", case, backend, str(src), uri],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{case}/{backend} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    size_mb = int(os.environ.get("BENCH_UPLOAD_MB", "1024"))
    only = set(filter(None, os.environ.get("BENCH_BACKENDS", "").split(",")))  # e.g. BENCH_BACKENDS=gs,oss/weed
    from pipeline_steps.store.oss import _tuning

    oss_part, parallel = _tuning(16)
    gcs_part = _tuning(100)[0]
    from pipeline_steps.local.object_store_stand_ins import GcsServer, OssServer, SeaweedServer

    with tempfile.TemporaryDirectory(prefix="bench-upload-") as tmp:
        tmp = Path(tmp)
        src = tmp / "src"
        src.mkdir()
        with open(src / "blob.bin", "wb") as f:  # incompressible data, written in chunks
            for _ in range(size_mb):
                f.write(os.urandom(1 << 20))
        common = {"PIPELINE_CACHE_DIR": str(tmp / "cache")}  # part sizes: the defaults, or PIPELINE_STORE_PART_MB
        oss_srv = OssServer(tmp, buckets=("bench",))
        weed = SeaweedServer(tmp)
        oss_weed = OssServer(tmp, buckets=("bench",), s3_url=weed.url)
        gcs_srv = GcsServer(tmp)
        rows = []
        try:
            gcs_srv.create_bucket("bench")
            backends = [
                ("file", f"file://{tmp}/store", {}),
                ("oss", "oss://bench", oss_srv.env()),
                ("oss/weed", "oss://bench", oss_weed.env()),
                ("gs", "gs://bench", gcs_srv.env()),
            ]
            warm = tmp / "warm"
            warm.mkdir()
            (warm / "w.bin").write_bytes(os.urandom(1 << 20))
            for name, root, env in backends:
                if only and name not in only:
                    continue
                env = {**common, **env}
                # a first write pays one-off server costs (SeaweedFS grows volumes for a new bucket): not measured
                _run("store", name, warm, f"{root}/warm-up", env)
                naive = _run("naive", name, src, f"{root}/naive", env)
                first = _run("store", name, src, f"{root}/store/v1", env)
                again = _run("store", name, src, f"{root}/store/v1", env)
                rows.append((name, naive, first, again))
        finally:
            for srv in (oss_srv, oss_weed, weed, gcs_srv):
                srv.stop()

    mib = 1 << 20
    budgets = {"file": 100, "oss": parallel * oss_part / mib + 100, "gs": gcs_part / mib + 100}
    print(
        f"\nupload of one {size_mb} MiB file. RSS budget (parts in flight x part size + 100 MB): oss {parallel} x "
        f"{oss_part / mib:g} MiB -> {budgets['oss']:.0f} MB; gs 1 x {gcs_part / mib:g} MiB -> {budgets['gs']:.0f} MB;"
        " file: copied by the kernel -> 100 MB"
    )
    hdr = (
        f"{'backend':8s} {'naive s':>8s} {'MB/s':>6s} {'RSS':>6s} {'cpu s':>6s} | {'store s':>8s} {'MB/s':>6s} "
        f"{'RSS':>6s}"
        f" {'cpu s':>6s} {'speed x':>7s} | {'re-up s':>7s} {'re-up %':>7s} {'sent':>5s} | targets"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, naive, first, again in rows:
        n_tp, s_tp = size_mb / naive["seconds"], size_mb / first["seconds"]
        re_up = 100 * again["seconds"] / first["seconds"]
        missed = [
            what
            for what, ok in (
                ("speed", s_tp >= n_tp),
                ("RSS", first["rss_mb"] <= budgets[name.split("/")[0]]),
                ("re-up time", re_up < 5),
                ("re-up bytes", again["sent"] == 0),
            )
            if not ok
        ]
        print(
            f"{name:8s} {naive['seconds']:8.2f} {n_tp:6.0f} {naive['rss_mb']:5.0f}M {naive['cpu_s']:6.2f} |"
            f" {first['seconds']:8.2f} {s_tp:6.0f} {first['rss_mb']:5.0f}M {first['cpu_s']:6.2f} {s_tp / n_tp:7.2f} |"
            f" {again['seconds']:7.2f} {re_up:6.1f}% {again['sent']:5d} | "
            f"{'met' if not missed else 'missed: ' + ', '.join(missed)}"
        )
    print(
        "\nRSS = peak RSS, cpu s = user+system CPU of the uploading process (servers not included);"
        " speed x = store throughput / naive throughput;"
        "\ntargets: speed x >= 1, store RSS <= budget, re-upload < 5% of the first upload's time with 0 bytes sent"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:6])
    else:
        main()
