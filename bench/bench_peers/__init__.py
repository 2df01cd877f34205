"""Shared harness, system drivers and peer apps (Celery, Dramatiq, RQ) for bench_e2e.py."""
