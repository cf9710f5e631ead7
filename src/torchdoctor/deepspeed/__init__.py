"""DeepSpeed doctor: ``torchdoctor ds check`` (config lint) and ``torchdoctor ds memory`` (ZeRO memory estimates)."""
