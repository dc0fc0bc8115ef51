"""Extra links on the task page."""

from __future__ import annotations

from airflow.sdk import BaseOperatorLink

DASHBOARD_XCOM_KEY = "ray_dashboard_url"


class RayDashboardLink(BaseOperatorLink):
    """Opens the Ray dashboard of the job's cluster (URL pushed to XCom by the operator)."""

    name = "Ray dashboard"

    def get_link(self, operator, *, ti_key) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        return XCom.get_value(key=DASHBOARD_XCOM_KEY, ti_key=ti_key) or ""
