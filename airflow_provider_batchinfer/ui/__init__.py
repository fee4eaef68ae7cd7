"""The batch runs in Airflow's UI: an Airflow plugin (``plugin.py``) with server-rendered pages."""
