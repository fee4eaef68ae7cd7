"""What a sensor's poke costs on a real S3 server, counted by the server: requests per poke.

A committed run directory of many tiny real Parquet parts and a valid ``_SUCCESS`` is put straight
into the S3 server; the sensor and its trigger then look at it through ``tests/s3_proxy.py``, which
logs every request it forwards. The first look at a marker checks every part (footers, and with
checksums the bytes); the process keeps that verdict, so every later look at the same marker bytes
reads the marker and lists the directory and makes no request per part, in both
``verify_checksums`` modes. The listing still shows a part removed, resized or rewritten, and the
check then reads the parts again. ``benchmarks/sensor_requests.py`` counts the same at 10,000 parts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, FileEntry, part_name
from tests.conftest import BackgroundServer, _free_port
from tests.runs import manifest_for, parquet_bytes
from tests.s3_proxy import read_log

KEY_ID, SECRET = "AKIDSENSORTEST", "sensor-secret"
#: parts of the run the request counts are taken on: enough that a per-part request shows as
#: hundreds; each request costs the S3 server a few ms of CPU, so 10,000 parts (and several
#: listing pages) are measured by ``python -m benchmarks.sensor_requests`` instead
PARTS = 200
#: keys in one page of an S3 listing
LIST_PAGE = 1000
_PROXY = "import sys, tests.s3_proxy as p; sys.exit(p.main())"


class LoggingProxy:
    """``tests/s3_proxy.py`` with no fault rules, in its own process: forwards every request to the
    S3 server and logs it."""

    def __init__(self, upstream: str, log: Path) -> None:
        self.log, self.port = log, _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", _PROXY, "--port", str(self.port), "--upstream", upstream, "--log", str(log)]
        self.server = BackgroundServer(f"s3-proxy-{self.port}", cmd, ports=[self.port], timeout=30)

    def requests(self, since: int = 0) -> list[dict]:
        return read_log(str(self.log))[since:]

    def stop(self) -> None:
        self.server.stop(timeout=10)


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET
    )


def put_committed_run(s3_server: str, bucket: str, run_key: str, parts: int) -> tuple[str, tuple[FileEntry, ...]]:
    """``parts`` one-row Parquet parts and a ``_SUCCESS`` listing them, put into the server directly
    (around the proxy) from a thread pool; returns the run directory and the parts' entries."""
    run_dir, client = f"s3://{bucket}/{run_key}", s3_client(s3_server)
    data = parquet_bytes([7])  # every part the same bytes: what is counted is requests, not contents
    digest = hashlib.sha256(data).hexdigest()
    entries = tuple(FileEntry(name=part_name(n, "t01abc"), size=len(data), rows=1, sha256=digest) for n in range(parts))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda e: client.put_object(Bucket=bucket, Key=f"{run_key}/{e.name}", Body=data), entries))
    manifest = manifest_for(run_dir, entries, attempt="t01abc")
    client.put_object(Bucket=bucket, Key=f"{run_key}/{SUCCESS_MARKER}", Body=manifest.to_json().encode())
    return run_dir, entries


def kind(request: dict) -> str:
    """``part`` (any request naming one part), ``marker``, ``list`` or ``other``."""
    path, _, query = request["target"].partition("?")
    if "/part-" in path:
        return "part"
    if path.endswith("/" + SUCCESS_MARKER):
        return "marker"
    if "list-type=2" in query:
        return "list"
    return "other"


def requests_of(proxy: LoggingProxy, look: Callable[[], object]) -> list[dict]:
    """The requests one call of ``look`` made, from the proxy's log."""
    seen = len(proxy.requests())
    look()
    return proxy.requests(seen)


def parts_read(requests: list[dict]) -> Counter[str]:
    """How often each part's bytes were read (a GET naming it)."""
    return Counter(r["target"].split("?")[0] for r in requests if r["method"] == "GET" and kind(r) == "part")


def options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "region": "us-east-1", "access_key": KEY_ID, "secret_key": SECRET}


@pytest.fixture
def proxy(s3_server, tmp_path, monkeypatch):
    """The logging proxy, and ``batchinfer_default`` pointing at it, as the sensor resolves it."""
    logging_proxy = LoggingProxy(s3_server, tmp_path / "proxy.log")
    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCHINFER_DEFAULT",
        json.dumps(
            {
                "conn_type": "batchinfer",
                "login": KEY_ID,
                "password": SECRET,
                "extra": {"endpoint_url": logging_proxy.endpoint, "region_name": "us-east-1", "s3_max_attempts": 3},
            }
        ),
    )
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    yield logging_proxy
    logging_proxy.stop()


def poke(run_dir: str, verify_checksums: bool) -> Callable[[], None]:
    """One poke of a fresh sensor (as every try builds one), which must find the run committed."""
    from airflow_provider_batchinfer.sensors.success_marker import SuccessMarkerSensor

    def look() -> None:
        sensor = SuccessMarkerSensor(task_id="gate", location=run_dir, verify_checksums=verify_checksums)
        assert sensor.poke({}).is_done

    return look


def test_after_the_first_poke_a_marker_costs_its_read_and_one_listing_whatever_the_parts(s3_server, s3_bucket, proxy):
    """The first pokes of the two modes run together (their checks are apart: neither verdict is
    the other's yet) and read every part; every later poke reads the marker (its bytes grow with
    the parts it lists, a request per so many of them) and lists the directory."""
    run_dir, _ = put_committed_run(s3_server, s3_bucket, "run", PARTS)
    with ThreadPoolExecutor(2) as pool:
        first = requests_of(proxy, lambda: list(pool.map(lambda mode: poke(run_dir, mode)(), (False, True))))
    assert len(parts_read(first)) == PARTS, "the first pokes read every part"
    pages = -(-(PARTS + 1) // LIST_PAGE)  # the parts and the marker
    for verify_checksums in (False, True, False, True):
        requests = requests_of(proxy, poke(run_dir, verify_checksums))
        later = Counter(kind(r) for r in requests)
        assert later["part"] == 0, requests
        assert later["list"] == pages and later.total() == later["marker"] + pages, requests


def rewrite(client: Any, bucket: str, key: str, data: bytes) -> None:
    """Put ``data`` under ``key`` until the listing shows a newer modification time (S3 keeps it to
    the second, so a rewrite within the second of the last write lists as unchanged)."""
    before = client.head_object(Bucket=bucket, Key=key)["LastModified"]
    while True:
        client.put_object(Bucket=bucket, Key=key, Body=data)
        if client.head_object(Bucket=bucket, Key=key)["LastModified"] > before:
            return
        time.sleep(0.05)


@pytest.mark.parametrize("verify_checksums", [False, True], ids=["footers", "checksums"])
def test_a_part_removed_resized_or_rewritten_after_the_verdict_fails_the_next_poke(
    s3_server, s3_bucket, proxy, verify_checksums
):
    """The verdict holds over the listing it was given on: names, sizes and modification times. A
    part rewritten with the same size is read again: garbage fails its footer, and a forged part
    with a valid footer fails its checksum (without checksums nothing but the bytes could tell)."""
    from airflow.sdk.exceptions import AirflowFailException

    run_dir, entries = put_committed_run(s3_server, s3_bucket, "run", 3)
    client, data = s3_client(s3_server), parquet_bytes([7])
    forged = parquet_bytes([7], scores=[8.0])
    assert len(forged) == len(data)
    key = [f"run/{e.name}" for e in entries]
    look = poke(run_dir, verify_checksums)
    look()
    client.put_object(Bucket=s3_bucket, Key=key[0], Body=data + b"\0")
    with pytest.raises(AirflowFailException, match=f"{entries[0].name} is {len(data) + 1} bytes but _SUCCESS says"):
        look()
    rewrite(client, s3_bucket, key[0], data)
    look()  # the same bytes again: read again, and the run holds
    client.delete_object(Bucket=s3_bucket, Key=key[1])
    with pytest.raises(AirflowFailException, match=f"{entries[1].name} is listed in _SUCCESS but missing"):
        look()
    client.put_object(Bucket=s3_bucket, Key=key[1], Body=data)
    look()
    rewrite(client, s3_bucket, key[2], forged if verify_checksums else b"\0" * len(data))
    damage = "does not match its sha256" if verify_checksums else "is not a readable Parquet file"
    with pytest.raises(AirflowFailException, match=f"{entries[2].name} {damage}"):
        look()


def test_triggers_deferred_together_on_one_marker_read_each_part_once(s3_server, s3_bucket, proxy):
    """Many sensors waiting on one run defer to one triggerer: their first checks run at once, in
    threads, and wait for one another instead of each reading every part. A verdict with checksums
    also vouches for the footers, so a sensor without checksums then reads no part either."""
    from airflow_provider_batchinfer.triggers.success_marker import SuccessMarkerTrigger

    run_dir, entries = put_committed_run(s3_server, s3_bucket, "run", 40)

    async def together(triggers: int) -> list[Any]:
        runs = [SuccessMarkerTrigger(location=run_dir, poll_interval=0.2).run() for _ in range(triggers)]
        return await asyncio.gather(*(r.__anext__() for r in runs))

    events: list[Any] = []
    first = requests_of(proxy, lambda: events.extend(asyncio.run(together(6))))
    assert [e.payload["status"] for e in events] == ["success"] * 6
    assert len(parts_read(first)) == len(entries) and set(parts_read(first).values()) == {1}
    assert not [r for r in requests_of(proxy, poke(run_dir, verify_checksums=False)) if kind(r) == "part"]


def test_a_verdict_without_checksums_never_stands_in_for_one_with_them(s3_server, s3_bucket, proxy):
    """Without checksums the footers are read once; the first sensor that asks for checksums still
    hashes every part (each check reads each part once: its end, or all of it), and that verdict
    also vouches for the footers."""
    run_dir, entries = put_committed_run(s3_server, s3_bucket, "run", 20)
    every_part, none = Counter(f"/{s3_bucket}/run/{e.name}" for e in entries), Counter()
    for n, (verify_checksums, expected) in enumerate(
        ((False, every_part), (False, none), (True, every_part), (True, none), (False, none))
    ):
        assert parts_read(requests_of(proxy, poke(run_dir, verify_checksums))) == expected, f"look {n}"
