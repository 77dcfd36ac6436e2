"""Data sources, partitions, corruption and per-client splits (local files only)."""
