"""An extra link from the inference task to its job in the Ray dashboard."""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow.sdk import BaseOperatorLink
from airflow.sdk.execution_time.xcom import XCom

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.definitions.taskinstancekey import TaskInstanceKey

XCOM_KEY = "ray_job_url"


class RayJobLink(BaseOperatorLink):
    """Shown on tasks that ran through the ``ray_jobs`` launcher; the operator pushes the URL."""

    name = "Ray job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return XCom.get_value(key=XCOM_KEY, ti_key=ti_key) or ""
