"""A ``ray_jobs`` job gets an S3 session derived through STS only when it reads or writes S3: a
connection with keys whose job's stage, registry, inputs and tables are all local asks no STS and
ships no key. Here STS is a listening socket on 127.0.0.1 that counts who connects to it (and
hangs up, as an unusable STS would)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import pytest

from airflow_provider_batchinfer.launchers.ray_jobs import RayJobsError, RayJobsLauncher

KEYS = {"access_key": "AKIDLOCAL0001", "secret_key": "local-secret-5e2b", "region": "us-east-1"}


@pytest.fixture
def sts() -> Iterator[dict[str, object]]:
    """An endpoint that accepts connections, counts them and closes each at once."""
    server = socket.create_server(("127.0.0.1", 0))
    seen = {"connections": 0, "url": f"http://127.0.0.1:{server.getsockname()[1]}"}

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            seen["connections"] = int(seen["connections"]) + 1  # type: ignore[call-overload]
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield seen
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept
    server.close()
    thread.join(timeout=5)


@pytest.mark.parametrize(
    ("locations", "expected"),
    [
        (("/data/stage/run1", "/data/registry/m/v1", "file:///data/in"), False),
        (("/data/stage/run1", "s3://lake/in/tickets.parquet"), True),
        (("/data/stage/run1", "s3a://lake/registry/m/v1"), True),
        (("/data/stage/run1", "lake"), True),  # a REST catalog's warehouse by name: it may be anywhere
        (("/data/stage/run1", "https://catalog:8181"), True),
        (None, True),  # not told: as before, a session whenever keys would be shipped
    ],
)
def test_a_job_needs_an_s3_session_when_any_of_its_locations_may_be_on_s3(locations, expected):
    from airflow_provider_batchinfer.launchers.job_env import needs_s3_session

    assert needs_s3_session(locations) is expected


def test_the_locations_name_stage_registry_roots_inputs_and_the_tables_warehouse():
    from airflow_provider_batchinfer.launchers.job_env import job_locations

    embedded = {"type": "sql", "uri": "sqlite:////s/_iceberg/catalog.db", "warehouse": "file:///s/_iceberg/warehouse"}
    assert job_locations("/s/run1", "/r/m/v1", ["/s", "s3://refs"], ["/in/a"], embedded) == (
        "/s/run1",
        "/r/m/v1",
        "/s",
        "s3://refs",
        "/in/a",
        "file:///s/_iceberg/warehouse",
    )
    assert job_locations("/s/run1", "/r/m/v1", [], None, {"type": "rest", "uri": "https://cat:8181"})[-1] == (
        "https://cat:8181"
    )


def test_a_local_job_asks_no_sts_and_ships_no_key_while_an_s3_job_is_refused(sts, caplog):
    caplog.set_level(logging.INFO)
    log = logging.getLogger("test_job_s3_session")
    launcher = RayJobsLauncher("http://127.0.0.1:1", storage_options={**KEYS, "sts_endpoint_url": sts["url"]})
    launcher.job_timeout = 600

    launcher.job_locations = ("/data/stage/run1", "/data/registry/text_length/v1", "/data/stage", "/data/in")
    env = launcher.prepare_env(log)

    assert sts["connections"] == 0
    assert env.expires is None and env.secret == {}
    assert env.public == {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_STS": sts["url"]}
    assert "no session is derived through STS and no key is shipped" in caplog.text
    shipped = repr(env.runtime_env(None, None))
    assert KEYS["access_key"] not in shipped and KEYS["secret_key"] not in shipped

    # the same connection, one input on S3: STS is asked, and its failure refuses the job
    launcher.job_locations = (*launcher.job_locations, "s3://lake/in/tickets.parquet")
    with pytest.raises(RayJobsError, match=rf"no job session could be derived through STS at {sts['url']}") as info:
        launcher.prepare_env(log)
    assert sts["connections"] >= 1
    assert KEYS["secret_key"] not in str(info.value)
