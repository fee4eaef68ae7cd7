"""The end of a job: the parts it writes, the manifest and the commit (a run directory or a table)."""
