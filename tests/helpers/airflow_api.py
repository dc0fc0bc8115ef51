"""The Airflow REST API (``/api/v2``) as the tests call it: JSON in, JSON out.

On two loaded cores the API server sometimes takes longer than a socket timeout to answer one
request while the scheduler, triggerer and training share the CPU (CI saw one 30 s read timeout in a
run that then succeeded), and on SQLite (the local profile) a write may answer 500 when the database stays locked
longer than the server waits (two suites on one machine saw one). A status poll is not the behaviour under test, so
a GET that times out or answers 5xx is asked again, a bounded number of times, and so is a write the caller marks
``idempotent`` (setting a run's state); other writes are never repeated (a second POST could start a second run).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request


def api(
    url: str,
    path: str,
    method: str = "GET",
    body: dict | None = None,
    timeout: float = 60,
    attempts: int = 4,
    idempotent: bool | None = None,
):
    req = urllib.request.Request(
        f"{url}/api/v2{path}",
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    again = method == "GET" if idempotent is None else idempotent
    for attempt in range(1, (attempts if again else 1) + 1):
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            if e.code < 500 or not again or attempt == attempts:  # the same error, with what the server said
                raise urllib.error.HTTPError(e.url, e.code, f"{e.msg}: {detail}", e.hdrs, None) from e
            print(f"{method} {path}: HTTP {e.code} {detail}; asking again ({attempt}/{attempts})")
            time.sleep(2)
        except (TimeoutError, socket.timeout, ConnectionResetError) as e:
            if not again or attempt == attempts:
                raise
            print(f"{method} {path}: {e!r}; asking again ({attempt}/{attempts})")
            time.sleep(2)
        except urllib.error.URLError as e:
            if not isinstance(e.reason, (TimeoutError, socket.timeout)) or not again or attempt == attempts:
                raise
            print(f"{method} {path}: {e!r}; asking again ({attempt}/{attempts})")
            time.sleep(2)
