"""What the operator reads from ``context["ti"]``, for tests that drive ``execute`` directly
(outside a scheduler) with a chosen dag/run/try identity."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TaskInstanceStandIn:
    dag_id: str = "bi_direct"
    task_id: str = "infer"
    run_id: str = "manual__2026-11-23T00:00:00+00:00"
    try_number: int = 1
    map_index: int = -1
    xcoms: dict = field(default_factory=dict)

    def xcom_push(self, key, value):
        self.xcoms[key] = value
