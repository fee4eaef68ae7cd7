"""``python -m airflow_provider_batchinfer.runtime --spec <job file>``: the runtime's entrypoint."""

from __future__ import annotations

import sys

from airflow_provider_batchinfer.runtime.reporting import main

if __name__ == "__main__":
    sys.exit(main())
