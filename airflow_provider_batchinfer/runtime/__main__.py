"""``python -m airflow_provider_batchinfer.runtime --spec <job file>``: the runtime's entrypoint.

Started by the ``local`` launcher, it first arms the watchdog that ends the job with its task
process (``BATCHINFER_PARENT_PID``); started any other way there is nothing to watch."""

from __future__ import annotations

import sys

from airflow_provider_batchinfer.runtime.reporting import main
from airflow_provider_batchinfer.runtime.watchdog import watch_parent

if __name__ == "__main__":
    watch_parent()
    sys.exit(main())
