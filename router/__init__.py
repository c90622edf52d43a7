"""Cluster scheduling: read both class queues, pick a worker, recover failures."""
