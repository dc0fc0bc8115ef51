"""A local stand-in for the parts of the Hugging Face Hub API that huggingface_hub's ``model_info(files_metadata=True)``
and ``hf_hub_download`` call (the real Hub is unreachable here): ``GET /api/models/{repo}/revision/{rev}`` (file list
with sizes, blob ids, LFS sha256) and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with ``X-Repo-Commit``,
``X-Linked-Etag``/``ETag`` and ``X-Linked-Size``. Point ``HF_ENDPOINT`` at ``url``."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubStandIn:
    def __init__(self, repo: str, files: dict[str, bytes], lfs_min: int = 1 << 20, corrupt: set[str] = frozenset()):
        self.repo, self.files, self.lfs_min, self.corrupt = repo, files, lfs_min, set(corrupt)
        self.gets: list[str] = []
        standin = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, headers, body=b""):
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def do_GET(self):
                standin._serve(self)

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _meta(self, name: str, data: bytes) -> dict:
        m = {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if len(data) >= self.lfs_min:
            sha = hashlib.sha256(data).hexdigest()
            m["lfs"] = {"sha256": "0" * 64 if name in self.corrupt else sha, "size": len(data), "pointerSize": 130}
        return m

    def _serve(self, h) -> None:
        path = unquote(h.path.split("?")[0])
        if path.startswith(f"/api/models/{self.repo}/revision/"):
            body = json.dumps(
                {"id": self.repo, "sha": COMMIT, "siblings": [self._meta(n, d) for n, d in self.files.items()]}
            ).encode()
            return h._send(200, {"Content-Type": "application/json"}, body)
        prefix = f"/{self.repo}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix) :].split("/", 1)[1]
            if name in self.files:
                data = self.files[name]
                m = self._meta(name, data)
                etag = m["lfs"]["sha256"] if "lfs" in m else m["blobId"]
                if h.command == "GET":
                    self.gets.append(name)
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"'}
                headers["X-Linked-Size"] = str(len(data))
                return h._send(200, headers, data)
        h._send(404, {"X-Error-Code": "EntryNotFound"}, b'{"error": "not found"}')

    def close(self):
        self.server.shutdown()
        self.server.server_close()
