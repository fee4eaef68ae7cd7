"""The embedded Ray on the Airflow worker's machine: its head, its state directories, the warm
runtime that keeps a job's process ready."""
