"""Apache Iceberg tables as input and output (docs/iceberg.md).

``names``: how tables are written in specs and locations (checked at parse time); ``catalog``: which
catalog a connection means (the embedded SQLite one by default) and opening it; ``read``: a committed
run's manifest and rows, and a pinned input snapshot. The commit itself is on the Ray side
(``runtime/output/table_commit.py``). Imports neither Airflow nor Ray.
"""

from airflow_provider_batchinfer.contract.specs.tables import (
    iceberg_input,
    is_run_location,
    is_table_input,
    run_location,
)

__all__ = ["iceberg_input", "is_run_location", "is_table_input", "run_location"]
