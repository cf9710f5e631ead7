"""What runs while a step runs: the hooks, the step's record of frames, the calls kept for a replay."""
