"""The report: where a value went non-finite, the frames before it, why, and what to do."""
