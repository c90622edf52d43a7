"""Cluster scheduling: read both class queues, pick a worker, relay tokens, recover failures."""
