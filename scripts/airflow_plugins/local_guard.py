"""Airflow plugin of the local profile (`make airflow`, `make demo`): the API server's Host check and one-click login.

- Every request that reaches the API server on a loopback address must name a loopback ``Host`` (localhost,
  127.0.0.1, [::1], any port): a page that rebinds its DNS name to 127.0.0.1 gets 403 before Airflow sees the request
  (:mod:`pipeline_steps.host_guard`).
- ``/pipeline/login#key=<password>``: the link `make airflow` prints. The page posts the key (from the URL's fragment,
  which no request carries: it stays out of the access log) to ``POST /pipeline/login``, which checks it as Airflow's
  simple auth manager checks a password (user ``admin``, the password generated per Airflow home in its passwords
  file, mode 0600), sets the same session cookie Airflow's own login form sets, and the page opens the UI: the user
  at the terminal is one click from the UI, anyone without the file is not (scripts/airflow_local.py).

Loaded through ``AIRFLOW__CORE__PLUGINS_FOLDER`` (scripts/airflow_local.py: ``airflow_env``).
"""

# no `from __future__ import annotations`: FastAPI reads the route's parameter types (Request) at definition

from airflow.plugins_manager import AirflowPlugin

from pipeline_steps.host_guard import LoopbackHostMiddleware

LOGIN_PREFIX = "/pipeline"
USER = "admin"


_PAGE = """<!doctype html><meta charset="utf-8"><meta name="referrer" content="no-referrer">
<title>Airflow: logging in</title>
<p id="m">Logging in ...</p>
<script>
const key = new URLSearchParams(location.hash.slice(1)).get("key") || "";
history.replaceState(null, "", location.pathname);  // the key leaves the address bar and the history
fetch("login", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify({key}),
                credentials: "same-origin"})
  .then(r => r.ok ? r.json().then(j => location.replace(j.next))
                  : (document.getElementById("m").textContent = "Refused: use the link `make airflow` printed."));
</script>
"""


def _login_app():
    from fastapi import Body, FastAPI, HTTPException, Request
    from fastapi.responses import HTMLResponse, JSONResponse

    app = FastAPI(title="local profile login", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/login")
    def page():
        # the key travels in the URL's fragment, which the browser never sends: it is in no access log
        return HTMLResponse(_PAGE, headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    @app.post("/login")
    def login(request: Request, key: str = Body("", embed=True)):
        from airflow.api_fastapi.app import get_cookie_path
        from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
        from airflow.api_fastapi.auth.managers.simple.datamodels.login import LoginBody
        from airflow.api_fastapi.auth.managers.simple.services.login import SimpleAuthManagerLogin

        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return JSONResponse({"detail": "send JSON"}, 415)  # no form post from another site's page
        try:  # Airflow's own password check (constant time) and token
            token = SimpleAuthManagerLogin.create_token(body=LoginBody(username=USER, password=key or "-"))
        except HTTPException:
            return JSONResponse({"detail": "refused: wrong or missing key"}, 401)
        response = JSONResponse({"next": get_cookie_path()})
        response.set_cookie(
            COOKIE_NAME_JWT_TOKEN,
            token,
            path=get_cookie_path(),
            secure=request.base_url.scheme == "https",
            httponly=True,
            samesite="lax",
        )
        return response

    return app


class LocalGuardPlugin(AirflowPlugin):
    name = "pipeline_local_guard"
    fastapi_root_middlewares = [{"name": "loopback Host only", "middleware": LoopbackHostMiddleware}]
    fastapi_apps = [{"name": "local profile login", "app": _login_app(), "url_prefix": LOGIN_PREFIX}]
