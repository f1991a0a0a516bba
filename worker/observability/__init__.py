"""What operators see of running workers: Prometheus metrics (per process) and the status view (from Redis)."""
