"""Apache Iceberg tables on the storage side (docs/iceberg.md): ``catalog``, which catalog a
connection means (the embedded SQLite one by default) and opening it; ``read``, a committed run's
manifest and rows, and a pinned input snapshot. How tables are written in specs and locations is
the contract's (``contract/specs/tables.py``); the commit itself is on the Ray side
(``runtime/output/table_commit.py``). Imports neither Airflow nor Ray.
"""
