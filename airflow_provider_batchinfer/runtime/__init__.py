"""The Ray side: runs as ``python -m airflow_provider_batchinfer.runtime --spec <job spec>``.

Nothing under this package imports Airflow, so Ray workers and GPU images stay small and their
dependencies (torch, vLLM) never fight Airflow's.
"""
