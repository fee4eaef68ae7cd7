"""What ``ray.init`` hands the job's workers (``runtime/attach.worker_runtime_env``), and when it attaches."""

from __future__ import annotations

from airflow_provider_batchinfer.runtime.attach import worker_runtime_env


def test_a_job_with_nothing_to_hand_its_workers_sets_no_runtime_env():
    # with one, every worker starts through Ray's runtime-env setup and the prestarted ones go unused;
    # the driver's model cache reaches the replicas as an argument (pool_dataset.replica_kwargs)
    environ = {"BATCHINFER_MODEL_CACHE": "/cache", "PATH": "/bin", "HOME": "/home/airflow"}
    assert worker_runtime_env(environ) == {}
    assert worker_runtime_env({**environ, "AWS_REGION": "eu-west-1"}) == {"env_vars": {"AWS_REGION": "eu-west-1"}}


def test_a_job_started_beside_the_embedded_rays_start_attaches_once_the_launcher_says_it_is_up(tmp_path):
    import threading

    import pytest

    from airflow_provider_batchinfer.contract.lines import EMBEDDED_RAY_READY_ENV
    from airflow_provider_batchinfer.runtime.attach import wait_for_embedded_ray
    from airflow_provider_batchinfer.runtime.errors import JobError

    wait_for_embedded_ray({}, timeout_s=0)  # started on a Ray that was up: no wait
    ready = tmp_path / "batchinfer-ready"
    with pytest.raises(JobError, match=r"the embedded Ray this job was started beside was not up after 0.2s \("):
        wait_for_embedded_ray({EMBEDDED_RAY_READY_ENV: str(ready)}, timeout_s=0.2)
    threading.Timer(0.2, ready.touch).start()
    wait_for_embedded_ray({EMBEDDED_RAY_READY_ENV: str(ready)}, timeout_s=30)
    assert ready.exists()
