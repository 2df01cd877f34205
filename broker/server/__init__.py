"""Process entry points that wire every package together: a cluster broker, a standalone one."""
