import sys

from airflow_provider_batchinfer.runtime.job import main

sys.exit(main())
