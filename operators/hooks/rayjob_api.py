"""The KubeRay ``RayJob`` hook: every RayJob call of the operators (sync) and the trigger (async) goes through it.

Sync calls use the cncf-kubernetes provider's :class:`KubernetesHook` (its custom-object client); the provider's
:class:`AsyncKubernetesHook` has no custom-object calls, so the async ones use ``kubernetes_asyncio``'s
``CustomObjectsApi`` on the async hook's connection.
"""

from __future__ import annotations

from functools import cached_property

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
RAY_TOKEN_KEY = "auth_token"  # KubeRay's RAY_AUTH_TOKEN_SECRET_KEY: the data key of a cluster's Ray token Secret


class RayJobHook(KubernetesHook):
    """The cncf-kubernetes hook with RayJob (``ray.io/v1``) calls, sync and async.

    :param conn_id: the Kubernetes connection (kube config path, in-cluster, or kube config JSON).
    :param cluster_context: kube config context, if not the connection's default.
    """

    # -- sync (operators) ---------------------------------------------------------------------------------
    def get_rayjob(self, name: str, namespace: str) -> dict | None:
        """The RayJob, or ``None`` when it does not exist."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.get_custom_object(GROUP, VERSION, PLURAL, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_rayjob(self, body: dict, namespace: str) -> dict:
        return self.create_custom_object(GROUP, VERSION, PLURAL, body, namespace)

    def delete_rayjob(self, name: str, namespace: str) -> bool:
        """Delete with foreground propagation (its RayCluster first); ``False`` if it was already gone."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.delete_custom_object(GROUP, VERSION, PLURAL, name, namespace, propagation_policy="Foreground")
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def list_rayjobs(self, namespace: str, label_selector: str) -> list[dict]:
        out = self.custom_object_client.list_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, label_selector=label_selector
        )
        return list(out.get("items") or [])

    # -- async (triggers) ---------------------------------------------------------------------------------
    @cached_property
    def async_hook(self) -> AsyncKubernetesHook:
        return AsyncKubernetesHook(conn_id=self.conn_id, cluster_context=self.cluster_context)

    async def async_get_rayjob(self, name: str, namespace: str) -> dict:
        """The RayJob; raises ``kubernetes_asyncio`` ``ApiException`` (404 when it is gone)."""
        from kubernetes_asyncio.client import CustomObjectsApi

        async with self.async_hook.get_conn() as api_client:
            return await CustomObjectsApi(api_client).get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name
            )

    async def async_delete_rayjob(self, name: str, namespace: str) -> bool:
        """Delete with foreground propagation; ``False`` if it was already gone."""
        from kubernetes_asyncio.client import CustomObjectsApi, V1DeleteOptions
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            async with self.async_hook.get_conn() as api_client:
                await CustomObjectsApi(api_client).delete_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, body=V1DeleteOptions(propagation_policy="Foreground")
                )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def async_submitter_log(self, name: str, namespace: str, tail_lines: int) -> list[str]:
        """The tail of the submitter pod's log (K8sJobMode: the submitter follows the Ray job's log)."""
        from kubernetes_asyncio.client import CoreV1Api

        async with self.async_hook.get_conn() as api_client:
            core = CoreV1Api(api_client)
            pods = await core.list_namespaced_pod(namespace, label_selector=f"batch.kubernetes.io/job-name={name}")
            if not pods.items:
                return []
            pod = max(pods.items, key=lambda p: str(p.metadata.creation_timestamp or ""))
            text = await core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=tail_lines)
            return str(text).splitlines()

    async def async_ray_token(self, secret: str, namespace: str) -> str | None:
        """The Ray token in Secret ``secret`` (key ``auth_token``, as KubeRay writes and reads it), for a request header
        to the Ray dashboard only (never logged); ``None`` when the Secret has no such key. Raises
        ``kubernetes_asyncio`` ``ApiException`` (403 when this identity may not read it, 404 when it is absent)."""
        import base64

        from kubernetes_asyncio.client import CoreV1Api

        async with self.async_hook.get_conn() as api_client:
            secret_obj = await CoreV1Api(api_client).read_namespaced_secret(secret, namespace)
        value = (secret_obj.data or {}).get(RAY_TOKEN_KEY)
        return base64.b64decode(value).decode().strip() if value else None
