"""Forged Iceberg runs for the trust tests, and a listener that records every request it gets.

Anyone who can commit to the connection's catalog can write a snapshot's summary, and so name any
manifest; anyone who can write that manifest names the run's claim and run directories. These
helpers do just that, with pyiceberg on the real (SQLite) catalog: :func:`forged_run` lays out a
run that passes every check of the manifest (a part, dead-lettered rows holding a secret, a claim
naming the attempt, a ``_manifest.json`` with its table section) wherever it is told, and
:func:`forge_snapshot` commits a snapshot whose summary names a manifest, with as many files and
rows as that manifest lists. :class:`Listener` answers a token endpoint (for ambient Google
credentials, :func:`ambient_google_credentials`) and a storage endpoint, and records each request.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, Manifest, part_name
from airflow_provider_batchinfer.contract.tables import (
    MODEL_VERSION_COLUMN,
    RUN_KEY_COLUMN,
    SUMMARY_PREFIX,
    TABLE_MANIFEST_FILE,
    TableOutput,
)
from tests.runs import manifest_for, write_part
from tests.ui_seed import error_part

ATTEMPT = "t01forge"


class Listener(http.server.BaseHTTPRequestHandler):
    """A token endpoint for the ambient credentials and a storage endpoint: records every request."""

    requests: list[tuple[str, str, str | None]] = []  # noqa: RUF012 (shared by the handler's instances)

    def _answer(self) -> None:
        self.requests.append((self.command, self.path, self.headers.get("Authorization")))
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/token"):
            status, body = 200, {"access_token": "ambient-token", "expires_in": 3600, "token_type": "Bearer"}
        else:
            status, body = 404, {"error": {"code": 404, "message": "no such object"}}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_HEAD = _answer

    def log_message(self, *args: Any) -> None:
        return None


@contextmanager
def listening() -> Iterator[int]:
    """A :class:`Listener` on 127.0.0.1 for the block; yields its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Listener)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def ambient_google_credentials(directory: Path, port: int) -> Path:
    """An ``authorized_user`` credentials file whose token endpoint is the listener: what a process's
    ambient Google credentials (``GOOGLE_APPLICATION_CREDENTIALS``) would spend on a ``gs://`` read."""
    path = directory / "adc.json"
    path.write_text(
        json.dumps(
            {
                "type": "authorized_user",
                "client_id": "c",
                "client_secret": "s",
                "refresh_token": "r",
                "token_uri": f"http://127.0.0.1:{port}/token",
            }
        )
    )
    return path


def gs_location(port: int, path: str) -> str:
    """A ``gs://`` URI whose query sends pyarrow's GCS filesystem to the listener over plain HTTP."""
    return f"gs://bucket/{path}?endpoint_override=127.0.0.1:{port}&scheme=http&retry_limit_seconds=1"


def forged_run(
    where: Path, identifier: str, run_key: str, secret: str, *, rows: int = 4, run_dir: str | None = None,
    claim_dir: str | None = None,
) -> tuple[str, Manifest]:  # fmt: skip
    """A run of ``identifier``/``run_key`` laid out under ``where`` that passes every check of the
    manifest: a part of ``rows`` rows, two dead-lettered rows whose message holds ``secret``, the
    claim naming :data:`ATTEMPT` and the manifest (its table section naming ``claim_dir`` and
    ``run_dir``, by default the ones under ``where``). Returns the manifest's location and the
    manifest."""
    run = where / "run"
    part = write_part(run, part_name(0, ATTEMPT), list(range(rows)))
    errors = error_part(run, part_name(0, ATTEMPT, dead_letter=True), [rows, rows + 1], secret)
    claim = where / "claim"
    claim.mkdir(parents=True, exist_ok=True)
    (claim / JOB_SPEC_FILE).write_text(json.dumps({"attempt": ATTEMPT}))
    target = TableOutput(identifier, {}, run_key, "error", claim_dir or str(claim), str(where))
    manifest = manifest_for(run_dir or str(run), (part,), (errors,), attempt=ATTEMPT)
    manifest = Manifest.from_dict({**manifest.to_dict(), "table": target.to_dict()}, "forged")
    (run / TABLE_MANIFEST_FILE).write_text(manifest.to_json())
    return str(run / TABLE_MANIFEST_FILE), manifest


def forge_snapshot(catalog_props: Mapping[str, str], identifier: str, run_key: str, manifest_location: str,
                   rows: int = 4) -> int:  # fmt: skip
    """Commit a snapshot of ``rows`` rows of ``run_key`` (one data file) into ``identifier``, created
    when missing, whose summary names ``manifest_location`` as the runtime's summary would; its id."""
    import pyarrow as pa
    from pyiceberg.exceptions import NoSuchTableError

    from airflow_provider_batchinfer.store.iceberg.catalog import open_catalog

    catalog = open_catalog(catalog_props)
    data = pa.table(
        {
            "ticket_id": pa.array(range(rows), pa.int64()),
            "length": pa.array(range(rows), pa.int64()),
            RUN_KEY_COLUMN: pa.array([run_key] * rows, pa.string()),
            MODEL_VERSION_COLUMN: pa.array(["v1"] * rows, pa.string()),
        }
    )
    try:
        table = catalog.load_table(identifier)
    except NoSuchTableError:
        catalog.create_namespace_if_not_exists(identifier.rpartition(".")[0])
        table = catalog.create_table(identifier, schema=data.schema)
    summary = {
        SUMMARY_PREFIX + "run-key": run_key,
        SUMMARY_PREFIX + "attempt": ATTEMPT,
        SUMMARY_PREFIX + "manifest": manifest_location,
    }
    table.append(data.cast(table.schema().as_arrow()), snapshot_properties=summary)
    snapshot = table.current_snapshot()
    assert snapshot is not None and snapshot.summary[SUMMARY_PREFIX + "manifest"] == manifest_location
    return int(snapshot.snapshot_id)
