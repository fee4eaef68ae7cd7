"""An auth manager for the services tests that keeps one user out of one DAG.

SimpleAuthManager grants by role, to every DAG alike; the batch runs pages must answer as the
core API does for a user who may not read a DAG, so this one denies the user and DAG named in
``BATCHINFER_TEST_DENIED`` (``<user>:<dag_id>``) every DAG permission, and defers to
SimpleAuthManager for everything else. The core API's DAG lists and checks, and the plugin's,
all come through ``is_authorized_dag``."""

from __future__ import annotations

import os
from typing import Any

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager


def _denied() -> tuple[str, str]:
    user, _, dag_id = os.environ.get("BATCHINFER_TEST_DENIED", "").partition(":")
    return user, dag_id


class DenyOneDagAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        denied_user, denied_dag = _denied()
        if denied_user and user.get_name() == denied_user and getattr(details, "id", None) == denied_dag:
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
