"""The two engines that score a job (the actor pool, the driver process) and the empty run."""
