"""What ``ray.init`` hands the job's workers (``runtime/attach.worker_runtime_env``)."""

from __future__ import annotations

from airflow_provider_batchinfer.runtime.attach import worker_runtime_env


def test_a_job_with_nothing_to_hand_its_workers_sets_no_runtime_env():
    # with one, every worker starts through Ray's runtime-env setup and the prestarted ones go unused;
    # the driver's model cache reaches the replicas as an argument (pool_dataset.replica_kwargs)
    environ = {"BATCHINFER_MODEL_CACHE": "/cache", "PATH": "/bin", "HOME": "/home/airflow"}
    assert worker_runtime_env(environ) == {}
    assert worker_runtime_env({**environ, "AWS_REGION": "eu-west-1"}) == {"env_vars": {"AWS_REGION": "eu-west-1"}}
