"""Training-log doctor: ``torchdoctor logs`` (analyse logs) and ``torchdoctor run`` (run a command, explain
how it ended)."""
