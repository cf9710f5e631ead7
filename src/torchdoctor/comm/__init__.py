"""Communication check and collective benchmark: ``torchdoctor comm``."""
