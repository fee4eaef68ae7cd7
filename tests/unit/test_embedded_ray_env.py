"""The environment and parameters the embedded Ray's head starts with (``launchers/embedded_ray.head_env``,
``launchers/embedded/ray_head.py``)."""

from __future__ import annotations

import sys

from airflow_provider_batchinfer.launchers.embedded.embedded_ray import WORKER_SOFT_LIMIT_ENV, head_env
from airflow_provider_batchinfer.launchers.embedded.ray_head import (
    PORTS,
    START_HOOK_ENV,
    call_operator_hook,
    head_params,
    skip_api_server,
)


def test_the_head_keeps_idle_task_workers_and_never_sees_another_clusters_address():
    env = head_env({"RAY_ADDRESS": "10.0.0.1:6379", "RAY_AUTH_TOKEN": "theirs", "PATH": "/bin"}, "token", "/t")
    assert env[WORKER_SOFT_LIMIT_ENV] == "64"
    assert "RAY_ADDRESS" not in env and "RAY_AUTH_TOKEN" not in env
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN_PATH"], env["PATH"]) == ("token", "/t", "/bin")


def test_an_operators_own_worker_soft_limit_and_socket_retries_win():
    assert head_env({WORKER_SOFT_LIMIT_ENV: "4"}, "token", "/t")[WORKER_SOFT_LIMIT_ENV] == "4"
    ours = head_env({}, "token", "/t")
    assert (
        int(ours["RAY_raylet_client_connect_timeout_milliseconds"])
        * int(ours["RAY_raylet_client_num_connect_attempts"])
        == 10_000
    )  # Ray's own budget (10 looks, 1 s apart), looked at more often
    theirs = head_env({"RAY_raylet_client_connect_timeout_milliseconds": "1000"}, "token", "/t")
    assert theirs["RAY_raylet_client_connect_timeout_milliseconds"] == "1000"


def test_the_head_starts_without_the_ray_client_server_the_autoscalers_monitor_and_the_api_server():
    from ray._private import node

    ports = {name: 20000 + n for n, name in enumerate(PORTS)}
    params = head_params(6390, "/tmp/bir-x", ports)
    assert (params.gcs_server_port, params.node_ip_address, params.temp_dir) == (6390, "127.0.0.1", "/tmp/bir-x")
    assert params.ray_client_server_port is None and params.no_monitor is True and params.include_dashboard is False
    assert (params.node_manager_port, params.metrics_agent_port, params.runtime_env_agent_port) == (
        ports["node-manager"],
        ports["dashboard-agent-grpc"],
        ports["runtime-env-agent"],
    )
    ray_own = node.Node.start_api_server
    try:
        skip_api_server()  # only in the head's own process, which runs nothing else
        assert node.Node.start_api_server is not ray_own
    finally:
        node.Node.start_api_server = ray_own


def test_an_operators_own_start_hook_is_called_after_the_heads_choices_and_wins(tmp_path, monkeypatch):
    (tmp_path / "operator_hook.py").write_text(
        "def hook(params, head):\n    params.ray_client_server_port = 10001 if head else None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    params = head_params(6390, "/tmp/bir-x", dict.fromkeys(PORTS, 0))
    call_operator_hook(params, {})
    assert params.ray_client_server_port is None
    call_operator_hook(params, {START_HOOK_ENV: "operator_hook.hook"})
    assert params.ray_client_server_port == 10001
    sys.modules.pop("operator_hook", None)


def test_the_heads_registration_lookup_leaves_the_decision_to_ray_when_it_cannot_ask():
    from airflow_provider_batchinfer.launchers.embedded.ray_head import _registered

    class Node:
        def __init__(self, hex_id: str) -> None:
            self.hex_id = hex_id

        def hex(self) -> str:
            return self.hex_id

    class Gcs:
        def __init__(self, nodes: list[Node] | None) -> None:
            self.nodes = nodes

        def get_all_node_info(self, timeout: float) -> dict[Node, object]:
            if self.nodes is None:
                raise TypeError("a client of another Ray")
            return dict.fromkeys(self.nodes)

    assert _registered(Gcs([Node("ab"), Node("cd")]), "cd") is True
    assert _registered(Gcs([Node("ab")]), "cd") is False  # not yet: look again
    assert _registered(Gcs(None), "cd") is None  # cannot ask: Ray's own lookup decides at once
