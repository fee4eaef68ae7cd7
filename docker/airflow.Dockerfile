# Airflow with the provider installed: api-server, scheduler, dag-processor and triggerer all use it.
# The Airflow side only submits and watches Ray jobs, so it needs neither torch nor a GPU.
# The base image's Airflow is the one constraints/constraints-3.11.txt pins (the tested set);
# tests/unit/test_docker_compose.py checks that they agree.
FROM apache/airflow:3.3.2-python3.11

COPY --chown=airflow:root pyproject.toml README.md LICENSE /opt/batchinfer/
COPY --chown=airflow:root constraints/constraints-3.11.txt /opt/batchinfer/constraints/constraints-3.11.txt
COPY --chown=airflow:root airflow_provider_batchinfer /opt/batchinfer/airflow_provider_batchinfer
RUN pip install --no-cache-dir -c /opt/batchinfer/constraints/constraints-3.11.txt "/opt/batchinfer[openlineage]"
