"""The coordinator (DP > 1): keeps the data-parallel ranks in step."""
