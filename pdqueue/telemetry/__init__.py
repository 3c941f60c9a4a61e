"""Prometheus metrics of workers, streams and the gateway."""
