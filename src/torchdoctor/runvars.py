"""Environment variables ``torchdoctor run`` sets for the command it starts, read inside that command's
processes (no torch import: ``run`` itself never imports torch)."""

#: the folder the numerics monitor writes its reports into when no ``report_dir`` is given
REPORT_DIR_VAR = "TORCHDOCTOR_REPORT_DIR"
