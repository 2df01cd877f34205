"""The wire between brokers and workers, shared by both sides: the frames
(``worker_protocol.py``, sans-IO) and the conversation table (``conversation.py``: which
frame may come when). Imports nothing from the project, so a worker depends on the broker
only where it must (docs/DESIGN.md §9).
"""
