"""A PySpark fan-out over a tracked task tree (issue 6): partitions, then a combiner."""
