"""Metrics, structured logs, the task log and the dashboard."""
