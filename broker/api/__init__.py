"""The HTTP JSON API: the ASGI app, its request/response models, edge limits, task output."""
