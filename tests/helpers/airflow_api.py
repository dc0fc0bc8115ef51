"""The Airflow REST API (``/api/v2``) as the tests call it: JSON in, JSON out.

On two loaded cores the API server sometimes takes longer than a socket timeout to answer one
request while the scheduler, triggerer and training share the CPU (CI saw one 30 s read timeout in a
run that then succeeded), and on SQLite (the local profile) a write may answer 500 when the database stays locked
longer than the server waits (two suites on one machine saw one). A status poll is not the behaviour under test, so
a GET that times out or answers 5xx is asked again, a bounded number of times, and so is a write the caller marks
``idempotent`` (setting a run's state); other writes are never repeated (a second POST could start a second run).

Every call logs in as the local profile's admin (scripts/airflow_local.py: its password is generated per Airflow
home), found by :func:`airflow_home`: the home a test's own ``start()`` used, else the one of the process listening
on the URL's port (a `make airflow` the test started). :func:`login_url` is the one-click link for a browser.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit


def airflow_home(url: str) -> Path:
    """The Airflow home of the API server at ``url`` (local profile)."""
    from scripts import airflow_local

    if url in airflow_local._HOMES:
        return airflow_local._HOMES[url]
    import psutil

    port = urlsplit(url).port
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            # the API server sets its process title, which overwrites its /proc environ (empty then): the nearest
            # ancestor that has one (the components' supervisor below `make airflow`) names the same home
            listener = psutil.Process(c.pid)
            for p in (listener, *listener.parents()):
                try:
                    home = p.environ().get("AIRFLOW_HOME")
                except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                    continue
                if home:
                    airflow_local._HOMES[url] = Path(home)
                    return Path(home)
    # an OSError, as a refused connection is: a caller waiting for the server to come up asks again
    raise ConnectionRefusedError(f"no Airflow API server of the local profile listens at {url}")


def login_url(url: str) -> str:
    """The link `make airflow` prints: opening it logs a browser in and shows the UI."""
    from scripts import airflow_local

    return airflow_local.login_url(url, airflow_local.ensure_password(airflow_home(url)))


def auth_headers(url: str, fresh: bool = False) -> dict[str, str]:
    from scripts import airflow_local

    return {"Authorization": f"Bearer {airflow_local.token(url, airflow_home(url), fresh=fresh)}"}


def api(
    url: str,
    path: str,
    method: str = "GET",
    body: dict | None = None,
    timeout: float = 60,
    attempts: int = 4,
    idempotent: bool | None = None,
    _fresh: bool = False,
):
    again = method == "GET" if idempotent is None else idempotent
    fresh = _fresh
    for attempt in range(1, (attempts if again else 1) + 1):
        req = urllib.request.Request(
            f"{url}/api/v2{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json", **auth_headers(url, fresh and attempt == 1)},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            if e.code == 401 and not fresh:  # an expired token: log in again, once (the request was refused whole)
                fresh = True
                return api(url, path, method, body, timeout, attempts, idempotent, _fresh=True)
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
