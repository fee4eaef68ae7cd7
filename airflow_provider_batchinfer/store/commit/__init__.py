"""The commit protocol: a run directory's claim (``fence``), its ``_SUCCESS`` marker and the
checks that read it back (``markers``, ``verdicts``), and the run directory's lifecycle (``rundir``)."""
