"""Planning before any compute: columns, the actor pool, what a job reserves on the cluster."""
