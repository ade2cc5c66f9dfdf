"""Telemetry: OpenTelemetry tracing set up from the standard OTEL_* variables, and Prometheus
metrics served on a per-worker text endpoint. Torch-free."""
