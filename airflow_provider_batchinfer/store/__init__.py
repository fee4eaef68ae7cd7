"""Where runs live: the stage (local or S3), its objects, the inputs' files, secrets in transit.

Both sides use it, so it imports neither Airflow nor Ray (nor ``runtime``)."""
