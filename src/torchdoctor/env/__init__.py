"""The CUDA-build doctor (``torchdoctor env``) and the bug-report bundle (``torchdoctor report``).

``facts`` holds what is found, ``probe`` finds it, ``rules`` judges it, ``prebuild`` and ``bundle`` turn it
into commands and a report; ``run`` and ``report_run`` are the thin CLI layers.
"""
