"""Material for ``torchdoctor demo``: a tiny T5-shaped model that overflows in fp16 (see model.py)."""
