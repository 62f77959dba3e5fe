"""A real redis-server started for the test run (filled in by the Redis tier work)."""
