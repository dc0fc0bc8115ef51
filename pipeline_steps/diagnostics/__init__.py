"""The checks of ``python -m pipeline_steps doctor`` beyond the API objects (pipeline_steps/steps/doctor.py): the
KubeRay operator's version, GPU capacity, and the services a run talks to (sandbox, MLflow, store).

Every check returns :class:`Check` lines; none prints a secret: a value read from a Secret or the environment only
goes into a request header, and response bodies are never shown (sandbox-manager echoes a refused key in its 401).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    fix: str = ""

    def line(self) -> str:
        head = f"[{'ok' if self.ok else 'FAIL'}] {self.name}" + (f": {self.detail}" if self.detail else "")
        return head if self.ok else f"{head}\n       fix: {self.fix}"


def safe_url(url: str) -> str:
    """``url`` without user info (a URI may carry credentials) or query, for a checklist line."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def http_status(url: str, headers: dict[str, str], timeout: float = 10.0) -> int:
    """The HTTP status of a GET (the body is read and dropped, never shown).

    :raises OSError: no answer (refused, DNS, TLS, timeout)
    """
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers=headers, method="GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read(1 << 16)
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def no_answer(exc: BaseException) -> str:
    """Why a request got no answer, in a few words (the URL is named by the caller)."""
    reason = getattr(exc, "reason", None) or exc
    return f"{type(reason).__name__}: {str(reason).splitlines()[0][:120]}" if str(reason) else type(reason).__name__
