"""Ways to run the runtime entrypoint. Each launcher takes a job spec location and returns the
runtime's result; the operator does not care where the job ran."""
