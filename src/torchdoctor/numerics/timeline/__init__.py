"""A numerics timeline: per-step, per-module statistics of a run, kept on the device and written in chunks.

``NumericsMonitor(record="run_dir")`` (``run --numerics --record DIR``) watches the recorded steps every module
and hands each one's statistics to :class:`~.store.TimelineWriter` (:mod:`.collect` gathers them on the device,
no host read); the writer appends them to ``run_dir/rank<r>/`` every ``record_flush`` recorded steps with one host
read, and before a ``NonFiniteError`` is raised, and as the monitor closes. :mod:`.store` also reads a run back.

Reading it (``torchdoctor numerics``, :mod:`torchdoctor.timeline_run` parses, :mod:`.commands` runs): :mod:`.grid`
turns a rank into rows (module outputs) x steps and folds keys, ranks and steps; :mod:`.show` makes the page of a
recording (:mod:`.html` assembles it, :mod:`.page_js` draws it in the browser); :mod:`.diff` aligns two recordings
and finds where they part, :mod:`.diff_report` says it (text, JSON, the page of both runs and their ratio).
"""
