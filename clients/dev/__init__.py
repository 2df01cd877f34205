"""Development launchers: local ZooKeeper, pulsar-lite and the `steward cluster up` cluster."""
