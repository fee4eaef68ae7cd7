"""Incremental scoring (``JobSpec(reuse="unchanged")``): keys, the earlier run, the match."""
