"""The replicated node: leader log writer, follower tail, snapshots."""
