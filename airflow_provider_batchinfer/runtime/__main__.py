"""``python -m airflow_provider_batchinfer.runtime --spec <job file>``: the runtime's entrypoint.

Started by the ``local`` launcher, it first arms the watchdog that ends the job with its task
process (``BATCHINFER_PARENT_PID``); started any other way there is nothing to watch.

Once ``main`` returns, the job is committed (or its failure reported), Ray is shut down and the
last line is flushed: the process leaves with ``os._exit``, skipping the interpreter's teardown,
which after torch's import takes ~0.5 s (unloading its libraries) and is a tenth of a small job's
time. Nothing the job wrote depends on it."""

from __future__ import annotations

import logging
import os
import sys

from airflow_provider_batchinfer.runtime.reporting import main
from airflow_provider_batchinfer.runtime.watchdog import watch_parent

if __name__ == "__main__":
    watch_parent()
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
