"""A local stand-in for the parts of the Hugging Face Hub API that huggingface_hub calls for ``model_info(
files_metadata=True)``, ``hf_hub_download`` and ``snapshot_download`` (the real Hub is unreachable here):
``GET /api/models/{repo}/revision/{rev}`` (files with sizes, blob ids, LFS sha256), ``/api/models/{repo}/tree/{rev}``
and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with ``X-Repo-Commit``, ``X-Linked-Etag``/``ETag`` and
``X-Linked-Size`` (LFS files: a 302 to a "CDN" on another host name, as the Hub does). Point ``HF_ENDPOINT`` at
``url``. ``corrupt`` names files whose advertised sha256 is wrong. Shared by the stage-model tests and
benchmarks/bench_staging.py."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubStandIn:
    def __init__(
        self, repo: str, files: dict[str, bytes | Path], lfs_min: int = 1 << 20, corrupt: set[str] = frozenset()
    ):
        self.repo, self.files, self.lfs_min, self.corrupt = repo, files, lfs_min, set(corrupt)
        self.gets: list[str] = []
        self.stall: str | None = None  # a GET of this file blocks until ``release`` is set (a test kills the client)
        self.release = threading.Event()
        self._metas: dict[str, dict] = {}
        standin = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, headers, body=b"", size=None):
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body) if size is None else size))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def do_GET(self):
                standin._serve(self)

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _chunks(self, name: str):
        data = self.files[name]
        if isinstance(data, bytes):
            yield data
            return
        with open(data, "rb") as f:  # large files (the benchmark) are served from disk, not memory
            while chunk := f.read(8 << 20):
                yield chunk

    def _meta(self, name: str) -> dict:
        if name in self._metas:
            return self._metas[name]
        size = sum(len(c) for c in self._chunks(name))
        sha1, sha = hashlib.sha1(b"blob %d\0" % size), hashlib.sha256()
        for c in self._chunks(name):
            sha1.update(c)
            sha.update(c)
        m = {"rfilename": name, "size": size, "blobId": sha1.hexdigest()}
        if size >= self.lfs_min:
            m["lfs"] = {"sha256": "0" * 64 if name in self.corrupt else sha.hexdigest(), "size": size, "pointerSize": 1}
        self._metas[name] = m
        return m

    def _content(self, h, name: str, headers: dict) -> None:
        if h.command == "HEAD":
            return h._send(200, headers, size=self._meta(name)["size"])
        self.gets.append(name)
        if name == self.stall:
            self.release.wait(60)
        h._send(200, headers, size=self._meta(name)["size"])
        for chunk in self._chunks(name):
            h.wfile.write(chunk)
        return None

    def _serve(self, h) -> None:
        path = unquote(h.path.split("?")[0])
        if path.startswith(f"/api/models/{self.repo}/revision/"):
            body = json.dumps(
                {"id": self.repo, "sha": COMMIT, "siblings": [self._meta(n) for n in self.files]}
            ).encode()
            return h._send(200, {"Content-Type": "application/json"}, body)
        if path.startswith(f"/api/models/{self.repo}/tree/"):  # snapshot_download's file list (the benchmark baseline)
            tree = []
            for n in self.files:
                m = self._meta(n)
                e = {"type": "file", "path": n, "size": m["size"], "oid": m["blobId"]}
                if "lfs" in m:
                    e["lfs"] = {"oid": m["lfs"]["sha256"], "size": m["size"], "pointerSize": 1}
                tree.append(e)
            return h._send(200, {"Content-Type": "application/json"}, json.dumps(tree).encode())
        prefix = f"/{self.repo}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix) :].split("/", 1)[1]
            if name in self.files:
                m = self._meta(name)
                etag = m["lfs"]["sha256"] if "lfs" in m else m["blobId"]
                headers = {"X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(m["size"])}
                if "lfs" in m:  # as the Hub does: LFS files redirect to a CDN host, the metadata is on the redirect
                    host = f"localhost:{self.server.server_address[1]}"  # another host name: not followed on HEAD
                    return h._send(302, {**headers, "Location": f"http://{host}/cdn/{name}"})
                if h.command == "HEAD":
                    return h._send(200, {**headers, "ETag": f'"{etag}"'})
                return self._content(h, name, {**headers, "ETag": f'"{etag}"'})
        if path.startswith("/cdn/") and path[5:] in self.files:
            return self._content(h, path[5:], {"ETag": f'"{self._meta(path[5:]).get("lfs", {}).get("sha256")}"'})
        h._send(404, {"X-Error-Code": "EntryNotFound"}, b'{"error": "not found"}')

    def close(self):
        self.server.shutdown()
        self.server.server_close()
