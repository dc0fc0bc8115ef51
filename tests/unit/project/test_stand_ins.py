"""The stand-ins the other tests rely on behave as the real services do where those tests depend on it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.k8s_connection import K8S_NAMESPACE, RAYJOB_CRD


def test_the_kubernetes_stand_in_refuses_a_wrong_token_as_an_api_server_does(tmp_path, monkeypatch):
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from kubernetes.client.exceptions import ApiException

    from tests.helpers.k8s_api_stand_in import StandIn

    api = StandIn(crd_file=RAYJOB_CRD)
    api.start()
    try:
        for conn, token in (("k8s_right", None), ("k8s_wrong", "stand-in-guessed")):
            cfg = api.kube_config(tmp_path / conn, namespace=K8S_NAMESPACE, token=token)
            monkeypatch.setenv(
                f"AIRFLOW_CONN_{conn.upper()}",
                json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(cfg)}}),
            )
        right = KubernetesHook(conn_id="k8s_right")
        with pytest.raises(ApiException) as missing:  # authenticated: the API answers (the object does not exist)
            right.get_custom_object("ray.io", "v1", "rayjobs", "nothing", namespace=K8S_NAMESPACE)
        assert missing.value.status == 404
        with pytest.raises(ApiException) as refused:
            KubernetesHook(conn_id="k8s_wrong").get_custom_object(
                "ray.io", "v1", "rayjobs", "nothing", namespace=K8S_NAMESPACE
            )
        assert refused.value.status == 401 and api.unauthorized == 1
    finally:
        api.stop()


def test_the_oss_test_server_stops_cleanly(tmp_path):
    from tests.helpers.storage_servers import OssServer

    srv = OssServer(tmp_path)
    srv.stop()  # asserts the server process ran its own stop() and exited 0 (it raised before)
    assert srv.proc.returncode == 0
