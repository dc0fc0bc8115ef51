"""The Hugging Face connection: its token for a step subprocess (downloads of gated or private repositories)."""

from __future__ import annotations


def hf_env(conn_id: str | None) -> dict[str, str]:
    """HF_TOKEN from a Hugging Face connection (password, or extra ``token``); none when the connection is absent."""
    if not conn_id:
        return {}
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception:  # no such connection: public repositories need no token
        return {}
    token = conn.password or (conn.extra_dejson or {}).get("token")
    return {"HF_TOKEN": token} if token else {}
