"""``torchdoctor precision``: will this model overflow or underflow in fp16 (or bf16), where, and what to do --
answered before training, from one fp32 forward and backward and one forward in the target dtype.

The data's way: :mod:`.load` builds the model and a batch; :mod:`.ops` records every op of a forward with the
module running it; :mod:`.probe` runs the passes (fp32 values, the target dtype's compute dtypes, gradients,
weights); :mod:`.predict` turns them into overflow / underflow / loss-scale findings; :mod:`.fix` searches the
smallest set of regions to keep in fp32 and verifies it; :mod:`.precision_run` is the command.
"""
