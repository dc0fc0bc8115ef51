"""The Airflow REST API (``/api/v2``) as the tests call it: JSON in, JSON out.

On two loaded cores the API server sometimes takes longer than a socket timeout to answer one
request while the scheduler, triggerer and training share the CPU (CI saw one 30 s read timeout in a
run that then succeeded). A status poll is not the behaviour under test, so a GET that times out is
asked again, a bounded number of times; writes are never repeated (a second POST could start a
second run).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request


def api(url: str, path: str, method: str = "GET", body: dict | None = None, timeout: float = 60, attempts: int = 4):
    req = urllib.request.Request(
        f"{url}/api/v2{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    for attempt in range(1, (attempts if method == "GET" else 1) + 1):
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except (TimeoutError, socket.timeout, ConnectionResetError) as e:
            if method != "GET" or attempt == attempts:
                raise
            print(f"GET {path}: {e!r}; asking again ({attempt}/{attempts})")
            time.sleep(2)
        except urllib.error.URLError as e:
            if not isinstance(e.reason, (TimeoutError, socket.timeout)) or method != "GET" or attempt == attempts:
                raise
            print(f"GET {path}: {e!r}; asking again ({attempt}/{attempts})")
            time.sleep(2)
