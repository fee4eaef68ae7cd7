"""A SQL input, handed to the job: the Airflow worker resolves the connection and runs no query.

The job reads the query (``runtime/inputs/sql_input.py``): in shards on Ray where the database can hash a
sharding column, else streamed by its driver, into ``_input/<attempt>/``. Here the connection
becomes a SQLAlchemy URL (the hook's ``sqlalchemy_url``, else its ``get_uri()``), which may hold a
password: it goes to the launcher as the job's secret (``Launcher.job_secrets``), delivered the way
the job's storage credentials are, and never into ``_job.json``, the Ray job's metadata or a log.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_batchinfer.contract.sql_input import SQL_URL_ENV


def database_url(conn_id: str) -> str:
    """The SQLAlchemy URL of the Airflow SQL connection ``conn_id``. Fails the task (no retry) for a
    connection whose hook is not a SQL hook."""
    from airflow.sdk import BaseHook

    db_hook: Any = BaseHook.get_connection(conn_id).get_hook()
    if not hasattr(db_hook, "get_conn") or not hasattr(db_hook, "get_uri"):
        raise AirflowFailException(f"connection {conn_id!r} is not a SQL connection (its hook has no get_conn)")
    try:
        return str(db_hook.sqlalchemy_url.render_as_string(hide_password=False))
    except (NotImplementedError, AttributeError):  # hooks that build no URL object: their own URI
        return str(db_hook.get_uri())


def job_secrets(conn_id: str) -> dict[str, str]:
    """What the job is given to reach the database: its URL, as a secret variable."""
    return {SQL_URL_ENV: database_url(conn_id)}
