"""The deployment's sandbox services: ``$PIPELINE_SANDBOX_SERVICES`` (Helm values), name -> E2B domain and the
Kubernetes Secret of its API key, and the default service ``$PIPELINE_E2B_DOMAIN``; :func:`with_sandbox_service`
fills a preset's ``cluster`` section with the service its code sandbox tool uses (``cluster.sandbox_service``).
"""

from __future__ import annotations

import json
import re

from pipeline_steps import settings
from pipeline_steps.errors import UserError
from pipeline_steps.training.cluster_section import DNS_SUBDOMAIN, SECRET_KEY
from pipeline_steps.training.experiment import Experiment

SANDBOX_DOMAIN_ENV = settings.E2B_DOMAIN  # the deployment's default sandbox service, for presets that name none
SANDBOX_SERVICES_ENV = settings.SANDBOX_SERVICES  # the deployment's named sandbox services (JSON, Helm values)
SANDBOX_KEY_SECRET = {"secret": "sandbox-api-key", "key": "apiKey"}  # the default service's API key (k8s/secrets/)
_HOST = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")
_SERVICE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SERVICES_SHAPE = '{"<name>": {"domain": "<E2B domain>", "secret": "<Secret name>", "key": "<key, default apiKey>"}}'


def sandbox_service_capacity(cluster: dict | None) -> tuple[int | None, str]:
    """The sandbox service a preset's ``cluster.sandbox_service`` names (else the deployment's default): its capacity
    (None: unknown) and where that comes from, for the pre-flight's sandbox count."""
    name = cluster.get("sandbox_service") if isinstance(cluster, dict) else None
    if name is None:
        domain = settings.get(SANDBOX_DOMAIN_ENV) or "(unset)"
        return None, f"the deployment's default sandbox service ${SANDBOX_DOMAIN_ENV}={domain}"
    svc = sandbox_services().get(name)
    if svc is None:
        return None, f"cluster.sandbox_service={name}"  # an unknown name: the RayJob render refuses it
    where = f"cluster.sandbox_service={name} (${SANDBOX_SERVICES_ENV}[{name!r}].capacity"
    return svc.get("capacity"), where + (")" if svc.get("capacity") else ": unset)")


def sandbox_services() -> dict[str, dict]:
    """The deployment's named sandbox services: ``$PIPELINE_SANDBOX_SERVICES`` (Helm values), name -> the E2B
    domain and the Kubernetes Secret (name, data key) holding its API key, and optionally its ``capacity`` (sandboxes
    at once, which the pre-flight checks a rollout against). Endpoints and Secret names only, never a key: presets
    of different sandbox services (guide 000's sandbox-manager, guide 003's AGS region) run from one Airflow, each
    naming its service by ``cluster.sandbox_service``."""
    raw = (settings.get(SANDBOX_SERVICES_ENV) or "").strip()
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise UserError(f"${SANDBOX_SERVICES_ENV}: not JSON; expected {_SERVICES_SHAPE}") from None
    if not isinstance(data, dict):
        raise UserError(f"${SANDBOX_SERVICES_ENV}: expected a JSON object {_SERVICES_SHAPE}")
    out = {}
    for name, svc in data.items():
        what = f"${SANDBOX_SERVICES_ENV}[{name!r}]"
        if not _SERVICE_NAME.match(str(name)):
            raise UserError(f"{what}: a service name is a lower-case DNS label (e.g. ags-shanghai)")
        if (
            not isinstance(svc, dict)
            or set(svc) - {"domain", "secret", "key", "capacity"}
            or not {"domain", "secret"} <= set(svc)
        ):
            raise UserError(f"{what}: expected {{domain, secret[, key, capacity]}}, e.g. {_SERVICES_SHAPE}")
        domain, secret, key = str(svc["domain"]), str(svc["secret"]), str(svc.get("key", "apiKey"))
        if not _HOST.match(domain):
            raise UserError(f"{what}.domain={domain!r}: not a domain name (e.g. ap-shanghai.tencentags.com)")
        if not (DNS_SUBDOMAIN.match(secret) and len(secret) <= 253):
            raise UserError(f"{what}.secret={secret!r}: not a Kubernetes Secret name")
        if not SECRET_KEY.match(key):
            raise UserError(f"{what}.key={key!r}: not a Secret data key")
        out[str(name)] = {"domain": domain, "secret": secret, "key": key}
        if "capacity" in svc:  # sandboxes the service holds at once: the pre-flight checks a rollout against it
            capacity = svc["capacity"]
            if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
                raise UserError(f"{what}.capacity={capacity!r}: sandboxes the service holds at once, an integer >= 1")
            out[str(name)]["capacity"] = capacity
    return out


def with_sandbox_service(exp: Experiment, cluster: dict) -> dict:
    """``cluster`` with the code sandbox tool's service (``E2B_DOMAIN`` and the ``E2B_API_KEY`` Secret reference)
    filled in, when the run's tool agent uses that tool; ``cluster`` unchanged otherwise.

    A preset names its service with ``cluster.sandbox_service``, looked up in the deployment's
    ``$PIPELINE_SANDBOX_SERVICES``; a preset that names none gets the deployment's default, ``$PIPELINE_E2B_DOMAIN``
    with the Secret ``sandbox-api-key``. An unknown name, or a run whose pods would have no endpoint, is refused
    here in one line, before a GPU is requested, not in the first rollout.
    """
    from pipeline_steps.tools import uses_code_sandbox

    name = cluster.get("sandbox_service")
    mt = "actor_rollout_ref.rollout.multi_turn."
    enabled = str(exp.verl.get(mt + "enable", False)).lower() in ("true", "1")
    if not enabled or not uses_code_sandbox(exp.verl.get(mt + "tool_config_path") or ""):
        if name is not None:
            raise UserError(
                f"cluster.sandbox_service={name!r}: this preset runs no code sandbox tool; remove the setting"
            )
        return cluster
    env = cluster.get("env") or {}
    if isinstance(env, dict) and {"E2B_DOMAIN", "E2B_API_URL"} & set(env):
        raise UserError(
            "cluster.env: E2B_DOMAIN / E2B_API_URL are the deployment's; name the service with "
            f"cluster.sandbox_service (a key of ${SANDBOX_SERVICES_ENV}) instead"
        )
    if any(isinstance(s, dict) and s.get("env") == "E2B_API_KEY" for s in cluster.get("secrets") or []):
        raise UserError(
            "cluster.secrets: E2B_API_KEY comes with the sandbox service (its Secret is named in "
            f"${SANDBOX_SERVICES_ENV}, or sandbox-api-key for ${SANDBOX_DOMAIN_ENV}); remove it from the preset"
        )
    if name is not None:
        services = sandbox_services()
        if name not in services:
            known = ", ".join(sorted(services)) or "none"
            raise UserError(
                f"cluster.sandbox_service={name!r}: not a sandbox service of this deployment (known: {known}); "
                f"add it to ${SANDBOX_SERVICES_ENV} in the Helm values or name one of those"
            )
        svc = services[name]
        domain, ref = svc["domain"], {"secret": svc["secret"], "key": svc["key"]}
    else:
        domain, ref = settings.get(SANDBOX_DOMAIN_ENV) or "", SANDBOX_KEY_SECRET
        if not domain:
            raise UserError(
                f"the code sandbox tool needs its sandbox service: set ${SANDBOX_DOMAIN_ENV} (Helm values) to your "
                f"sandbox-manager's domain, or name a service of ${SANDBOX_SERVICES_ENV} in cluster.sandbox_service"
            )
        if not _HOST.match(domain):
            raise UserError(f"${SANDBOX_DOMAIN_ENV}={domain!r}: not a domain name (e.g. sandbox.example.com)")
    out = dict(cluster)
    out["env"] = {**env, "E2B_DOMAIN": domain}
    out["secrets"] = [*(cluster.get("secrets") or []), {"env": "E2B_API_KEY", **ref}]
    return out
