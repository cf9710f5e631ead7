"""The CUDA-build doctor (``torchdoctor env``) and the bug-report bundle (``torchdoctor report``).

``facts`` holds what is found; ``probe`` finds it (with ``toolkits`` and ``compilers``; ``tools`` runs every
external tool, ``progress`` says on stderr what a slow probe waits for); ``rules`` judges it (``rules_cuda``,
``rules_gpu``, ``rules_build`` over ``rules_common``); ``prebuild`` and ``bundle`` (rendered by ``bundle_render``)
turn it into commands and a report; ``run`` and ``report_run`` are the thin CLI layers.
"""
