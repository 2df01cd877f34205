"""The worker side of a broker: the wire protocol (shared with clients/worker) and the link."""
