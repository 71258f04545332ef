"""GQA attention, dense or sliding window (issue 6)."""
