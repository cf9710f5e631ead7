"""At a step's boundary: the verdict with one host read, shared across ranks, the replay of a bad step."""
