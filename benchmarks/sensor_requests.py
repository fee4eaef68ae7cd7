"""What the sensor's check costs in requests on an S3 server, per look, at 10,000 parts.

Starts its own ``moto_server`` on 127.0.0.1 (as the tests do), puts a committed run directory of
``--parts`` one-row Parquet parts and a valid ``_SUCCESS`` into it, then calls
``read_valid_manifest`` as the sensor's poke does (``PROCESS_VERDICTS``) through
``tests/s3_proxy.py``, which logs every request. Each ``verify_checksums`` mode has its own proxy,
so the two first looks run side by side and each log holds one mode's requests; then ``--looks``
more looks per mode, one at a time. Prints, per look, its requests by kind (``part``: any request
naming a part; ``marker``; ``list``: listing pages) and its seconds, then one JSON line.

    python -m benchmarks.sensor_requests [--parts 10000] [--looks 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = {"footers": False, "checksums": True}


def look(proxy, run_dir: str, verify_checksums: bool) -> dict:
    """One look as the sensor's poke takes it: its requests by kind and its seconds."""
    from airflow_provider_batchinfer.store.commit.verdicts import PROCESS_VERDICTS
    from airflow_provider_batchinfer.store.committed import read_valid_manifest
    from tests.e2e.test_sensor_requests import kind, options

    seen = len(proxy.requests())
    start = time.perf_counter()
    manifest = read_valid_manifest(
        run_dir, options(proxy.endpoint), verify_checksums=verify_checksums, verdicts=PROCESS_VERDICTS
    )
    seconds = time.perf_counter() - start
    assert manifest is not None, f"no marker in {run_dir}"
    return {"seconds": round(seconds, 2), "requests": dict(Counter(kind(r) for r in proxy.requests(seen)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=10_000)
    parser.add_argument("--looks", type=int, default=3, help="looks per mode after the first")
    args = parser.parse_args()
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    from tests.conftest import BackgroundServer, _free_port
    from tests.e2e.test_sensor_requests import LoggingProxy, put_committed_run, s3_client

    port = _free_port()
    server = BackgroundServer(
        "moto-sensor-requests",
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        [port],
    )
    upstream, proxies = f"http://127.0.0.1:{port}", {}
    try:
        with tempfile.TemporaryDirectory(prefix="sensor-requests-") as logs:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            s3_client(upstream).create_bucket(Bucket=bucket)
            result: dict = {"parts": args.parts, "load": os.getloadavg()[0]}
            start = time.perf_counter()
            run_dir, _ = put_committed_run(upstream, bucket, "run", args.parts)
            result["put_s"] = round(time.perf_counter() - start, 1)
            print(f"put {args.parts} parts and _SUCCESS: {result['put_s']} s", flush=True)
            proxies = {mode: LoggingProxy(upstream, Path(logs) / f"{mode}.log") for mode in MODES}
            with ThreadPoolExecutor(len(MODES)) as pool:  # the two first looks side by side
                firsts = dict(zip(MODES, pool.map(lambda m: look(proxies[m], run_dir, MODES[m]), MODES), strict=True))
            for mode, checksums in MODES.items():
                looks = [firsts[mode]] + [look(proxies[mode], run_dir, checksums) for _ in range(args.looks)]
                for n, one in enumerate(looks, 1):
                    print(f"{mode:9} look {n}: {one['seconds']:7.2f} s  {one['requests']}", flush=True)
                result[mode] = looks
            result["load_after"] = os.getloadavg()[0]
            print(json.dumps(result))
    finally:
        for proxy in proxies.values():
            proxy.stop()
        server.stop(timeout=30)


if __name__ == "__main__":
    main()
