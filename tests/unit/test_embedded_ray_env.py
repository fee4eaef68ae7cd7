"""The environment the embedded Ray's head starts with (``launchers/embedded_ray.head_env``)."""

from __future__ import annotations

from airflow_provider_batchinfer.launchers.embedded_ray import WORKER_SOFT_LIMIT_ENV, head_env


def test_the_head_keeps_idle_task_workers_and_never_sees_another_clusters_address():
    env = head_env({"RAY_ADDRESS": "10.0.0.1:6379", "RAY_AUTH_TOKEN": "theirs", "PATH": "/bin"}, "token", "/t")
    assert env[WORKER_SOFT_LIMIT_ENV] == "64"
    assert "RAY_ADDRESS" not in env and "RAY_AUTH_TOKEN" not in env
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN_PATH"], env["PATH"]) == ("token", "/t", "/bin")


def test_an_operators_own_worker_soft_limit_wins():
    assert head_env({WORKER_SOFT_LIMIT_ENV: "4"}, "token", "/t")[WORKER_SOFT_LIMIT_ENV] == "4"
