"""The environment the embedded Ray's head starts with (``launchers/embedded_ray.head_env``)."""

from __future__ import annotations

from airflow_provider_batchinfer.launchers.embedded_ray import START_HOOK_ENV, WORKER_SOFT_LIMIT_ENV, head_env


def test_the_head_keeps_idle_task_workers_and_never_sees_another_clusters_address():
    env = head_env({"RAY_ADDRESS": "10.0.0.1:6379", "RAY_AUTH_TOKEN": "theirs", "PATH": "/bin"}, "token", "/t")
    assert env[WORKER_SOFT_LIMIT_ENV] == "64"
    assert "RAY_ADDRESS" not in env and "RAY_AUTH_TOKEN" not in env
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN_PATH"], env["PATH"]) == ("token", "/t", "/bin")


def test_an_operators_own_worker_soft_limit_wins():
    assert head_env({WORKER_SOFT_LIMIT_ENV: "4"}, "token", "/t")[WORKER_SOFT_LIMIT_ENV] == "4"


def test_the_head_starts_without_the_ray_client_server_the_autoscalers_monitor_and_the_api_server():
    from ray._private.parameter import RayParams

    from airflow_provider_batchinfer.launchers.ray_head_hook import HOOK, trim_head

    assert head_env({}, "token", "/t")[START_HOOK_ENV] == HOOK
    assert head_env({START_HOOK_ENV: "theirs.hook"}, "token", "/t")[START_HOOK_ENV] == "theirs.hook"
    from ray._private import node

    ray_own = node.Node.start_api_server
    params = RayParams(ray_client_server_port=10001)  # what `ray start --head` passes its hook
    worker = RayParams(ray_client_server_port=10001)
    try:
        trim_head(worker, head=False)  # a worker node's start is left as it is
        assert worker.ray_client_server_port == 10001 and worker.no_monitor is False
        assert node.Node.start_api_server is ray_own
        trim_head(params, head=True)
        assert params.ray_client_server_port is None and params.no_monitor is True
        assert node.Node.start_api_server is not ray_own  # no API server: ray start's own process is patched
    finally:
        node.Node.start_api_server = ray_own
