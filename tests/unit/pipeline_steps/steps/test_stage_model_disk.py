"""stage-model refuses a model larger than the worker's free disk before fetching a byte (issue 24, fault 9, part).

A local stand-in for the Hub's model API (the real Hub is unreachable here) answers the real huggingface_hub
client's ``model_info(files_metadata=True)`` with a file of 10 PB, larger than any disk; it records every request,
so the test sees that no file download was attempted. The old step started the download and failed later, with the
Hub's error and not a word about disk.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers.step_cli import run_step

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_a_model_larger_than_the_disk_is_refused_before_download(tmp_path):
    seen: list[str] = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            seen.append(self.path)
            if self.path.startswith("/api/models/Qwen/Qwen2.5-32B-Instruct/revision/main"):
                body = json.dumps(
                    {
                        "id": "Qwen/Qwen2.5-32B-Instruct",
                        "sha": COMMIT,
                        "siblings": [
                            {"rfilename": "config.json", "size": 700},
                            {"rfilename": "model-00001-of-00001.safetensors", "size": 10**16},
                        ],
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
            else:
                body = b'{"error": "not served by this stand-in"}'
                self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "HF_HUB_ETAG_TIMEOUT": "2",
    }
    try:
        rc, summary, err = run_step(
            "stage-model", "--model", "Qwen/Qwen2.5-32B-Instruct", "--dest", (tmp_path / "store").as_uri(), env=env
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert rc == 2, err
    assert "10000000.0 GB" in err and "GB free" in err and "stage_model task more disk" in err
    assert any(p.startswith("/api/models/") for p in seen), seen  # the sizes were asked for
    assert not any("/resolve/" in p for p in seen), seen  # and no file was downloaded
