"""The Airflow plugin the provider ships: the batch-runs pages, mounted in the api-server.

Registered through the ``airflow.plugins`` entry point, so every Airflow component imports this
module; it stays light: the app (FastAPI routes, templates, the queries) is built the first time
the api-server asks for it. A provider that cannot build it (a missing dependency) logs why and
mounts nothing, and the api-server runs on without the pages.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any

from airflow.plugins_manager import AirflowPlugin

log = logging.getLogger(__name__)

URL_PREFIX = "/batchinfer"


class BatchInferencePlugin(AirflowPlugin):
    """Batch runs (every run, newest first), one run (its manifest) and a task's trends."""

    name = "batchinfer"
    # the nav entry: the pages in an iframe of Airflow's UI at /plugin/batch-runs; href is relative
    # to the UI's base URL, so a path prefix behind a proxy is kept
    external_views = [  # noqa: RUF012 (AirflowPlugin declares these as class-level lists)
        {
            "name": "Batch runs",
            "href": URL_PREFIX.lstrip("/") + "/runs",
            "destination": "nav",
            "category": "browse",
            "url_route": "batch-runs",
        }
    ]

    @cached_property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        try:
            from airflow_provider_batchinfer.ui.app import create_app

            app = create_app()
        except Exception:
            log.exception("the batch inference pages are not mounted: their app could not be built")
            return []
        return [{"app": app, "url_prefix": URL_PREFIX, "name": "Batch inference runs"}]
