"""Reading a job's input on the Ray side: small and Parquet inputs, SQL queries, Iceberg snapshots."""
