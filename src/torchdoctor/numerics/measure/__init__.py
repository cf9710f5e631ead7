"""On-device values: statistics of a tensor, gathered a few dispatches at a time, and the slots that name them."""
