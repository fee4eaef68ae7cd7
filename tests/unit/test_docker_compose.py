"""The docker/ deployment cannot be built here (no Docker engine), so its internal consistency is
checked instead: services, images, referenced files, and the connection that wires Airflow to Ray."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


def _env() -> dict[str, str]:
    lines = (DOCKER / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


@pytest.fixture(scope="module")
def compose() -> dict:
    text = (DOCKER / "docker-compose.yml").read_text()
    env = _env()
    unknown = sorted(set(re.findall(r"(?<!\$)\$\{(\w+)\}", text)) - set(env))
    assert not unknown, f"variables used in docker-compose.yml but missing from .env.example: {unknown}"
    return yaml.safe_load(re.sub(r"(?<!\$)\$\{(\w+)\}", lambda m: env[m.group(1)], text))


def test_every_service_the_deployment_needs_is_there(compose):
    services = compose["services"]
    for name in (
        "postgres",
        "airflow-apiserver",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "ray-head",
        "ray-gpu-worker",
        "minio",
    ):
        assert name in services, name
    assert services["airflow-triggerer"]["command"] == "triggerer"
    gpu = services["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_builds_and_copied_files_exist(compose):
    for name, service in compose["services"].items():
        build = service.get("build")
        if not build:
            continue
        context = (DOCKER / build["context"]).resolve()
        dockerfile = context / build["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY"):
                sources = [p for p in line.split()[1:-1] if not p.startswith("--")]
                for src in sources:
                    assert (context / src).exists(), f"{dockerfile.name}: COPY source {src} missing"
    images = {s.get("image") for s in compose["services"].values()}
    assert "batchinfer/ray:latest" in images and "batchinfer/airflow:latest" in images


def test_bind_mounts_point_at_real_paths(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DOCKER / source).resolve().exists(), f"{name}: mount source {source} missing"
            else:
                assert source in compose["volumes"], f"{name}: named volume {source} not declared"


def test_airflow_is_wired_to_the_ray_jobs_api_with_the_cluster_token(compose):
    services = compose["services"]
    env = _env()
    head_cmd = services["ray-head"]["command"]
    dashboard_port = re.search(r"--dashboard-port=(\d+)", head_cmd).group(1)
    gcs_port = re.search(r"--port=(\d+)", head_cmd).group(1)
    assert f"--address=ray-head:{gcs_port}" in services["ray-gpu-worker"]["command"]
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"):
        conn = json.loads(services[name]["environment"]["AIRFLOW_CONN_BATCHINFER_DEFAULT"])
        assert conn["conn_type"] == "batchinfer" and conn["extra"]["launcher"] == "ray_jobs"
        assert conn["host"] == f"http://ray-head:{dashboard_port}"
        assert (
            conn["extra"]["ray_token"] == env["RAY_AUTH_TOKEN"] == services["ray-head"]["environment"]["RAY_AUTH_TOKEN"]
        )
        stage = conn["extra"]["stage_root"]
        mounts = [v.split(":")[1] for v in services[name]["volumes"]]
        assert any(stage.startswith(m) for m in mounts), f"{name}: stage {stage} is not on a mounted volume"
        assert any(stage.startswith(v.split(":")[1]) for v in services["ray-head"]["volumes"]), (
            "Ray cannot see the stage"
        )
        assert services[name]["environment"]["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"].startswith(
            "http://airflow-apiserver:"
        )
    assert "airflow" not in (DOCKER / "ray-requirements.txt").read_text()  # the Ray side never needs Airflow


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def test_images_install_the_tested_set():
    """Both images install with the constraints file, and their base images carry the Airflow and the
    Ray that it pins; the vLLM build args pin what pyproject.toml's [llm] extra pins."""
    import tomllib

    constraints = REPO / "constraints" / "constraints-3.11.txt"
    pins = _pins(constraints)
    airflow = (DOCKER / "airflow.Dockerfile").read_text()
    ray = (DOCKER / "ray.Dockerfile").read_text()
    assert f"FROM apache/airflow:{pins['apache-airflow']}-python3.11" in airflow
    assert f"FROM rayproject/ray:{pins['ray']}-py311-gpu" in ray
    for text in (airflow, ray):
        assert re.search(r"pip install [^\n]*-c \S*constraints-3\.11\.txt", text), (
            "install without the constraints file"
        )
    llm = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["llm"]
    for requirement in llm:
        assert f'"{requirement}"' in ray, f"ray.Dockerfile does not install {requirement} like the [llm] extra"
    assert f"ray[llm]=={pins['ray']}" in llm
