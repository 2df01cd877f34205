"""The pure replicated state machine: log entries, apply, the scheduler (no IO, no asyncio)."""
