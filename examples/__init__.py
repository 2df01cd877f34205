"""Runnable examples of Steward (run them from the repository root)."""
