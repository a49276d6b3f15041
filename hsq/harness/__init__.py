"""The test and benchmark harness: real processes (redis-server, servers, workers) and
synthetic data. Never imported by contracts or services (docs/architecture.md)."""
