"""Shared harness and peer apps (Celery, Dramatiq) for bench_e2e.py and bench_roundtrip.py."""
