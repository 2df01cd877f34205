"""Credentials and transport security shared by brokers, workers and clients: tokens, TLS."""
