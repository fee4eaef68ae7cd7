"""Check that the embedded Ray refuses callers without its token: its GCS answers an unauthenticated
gRPC call with UNAUTHENTICATED and one with the token with OK; a Ray Client server (which the
embedded Ray starts without, ``launchers/embedded/ray_head.py``, unless an operator's own ``RAY_START_HOOK``
asks for one) answers it with UNAUTHENTICATED.

Why a raw gRPC call: a driver without the token does not fail, it retries until its own timeout
(a minute and more), which says nothing certain; the server's status code does.

Usage:
    python scripts/embedded_ray_auth_check.py <state dir>          probe the Ray recorded there
    python scripts/embedded_ray_auth_check.py --start <state dir>  start it (as a job would, with
                                                                   RAY_AUTH_MODE=disabled in the
                                                                   environment), probe it, stop it
Exit status 0 when every probe came out as expected.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import grpc

from airflow_provider_batchinfer.launchers.embedded import embedded_ray
from airflow_provider_batchinfer.launchers.embedded.procs import group_cmdlines


def _call(address: str, token: str | None, client: bool) -> str:
    """The status of one call (``OK`` or the gRPC code's name)."""
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        try:
            if client:
                request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
                ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(request, timeout=30, metadata=metadata)
            else:
                stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
                stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=30, metadata=metadata)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return "OK"


def probe(state: embedded_ray.EmbeddedRay) -> list[str]:
    """What is wrong with the recorded Ray's authentication (nothing: an empty list)."""
    client = [line for line in group_cmdlines(state.head_pid) if "ray.util.client.server" in line]
    client_port = re.search(r"--port=(\d+)", client[0]) if client else None
    token = Path(state.token_path).read_text().strip() if state.token_path else None
    checks = [("GCS without the token", state.address, None, False, {"UNAUTHENTICATED"})]
    checks.append(("GCS with the token", state.address, token, False, {"OK"}))
    if client_port:  # UNAVAILABLE: nothing listens there
        address = f"127.0.0.1:{client_port[1]}"
        checks.append(("Ray Client server without the token", address, None, True, {"UNAVAILABLE", "UNAUTHENTICATED"}))
    else:
        print("  no Ray Client server among the head's processes: nothing to probe there")
    wrong = []
    if state.auth_mode != "token":
        wrong.append(f"state.json records auth {state.auth_mode!r}")
    for what, address, with_token, client, expected in checks:
        got = _call(address, with_token, client)
        print(f"  {what} ({address}): {got}")
        if got not in expected:
            wrong.append(f"{what}: {got}, expected {' or '.join(sorted(expected))}")
    return wrong


def main(argv: list[str]) -> int:
    start = argv[:1] == ["--start"]
    if len(argv) != 1 + start:
        print(__doc__, file=sys.stderr)
        return 2
    directory = Path(argv[-1])
    log = logging.getLogger("embedded_ray_auth_check")
    if start:
        version = embedded_ray.installed_ray_version()
        environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        environ["RAY_AUTH_MODE"] = "disabled"  # a worker's setting for some other cluster: never the embedded Ray's
        with embedded_ray.locked(directory):
            embedded_ray.acquire(directory, 60.0, version or "unknown", environ, log)
    try:
        state = embedded_ray.read_state(directory)
        if state is None:
            print(f"no embedded Ray recorded in {directory}", file=sys.stderr)
            return 1
        print(f"embedded Ray {state.ray_version} at {state.address}:")
        wrong = probe(state)
    finally:
        if start:
            embedded_ray.shutdown(directory)
    for line in wrong:
        print(f"  WRONG: {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main(sys.argv[1:]))
