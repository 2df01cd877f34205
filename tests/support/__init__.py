"""Helpers the tests share: launchers, fixtures modules, fakes and probes (docs/TESTING.md)."""
