"""Code shared by every pagedserve component: frozen config, typed messages, ZeroMQ queues."""
