"""High availability: leader election on ZooKeeper and code artifact replication."""
