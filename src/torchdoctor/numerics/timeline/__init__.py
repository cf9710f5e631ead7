"""A numerics timeline: per-step, per-module statistics of a run, kept on the device and written in chunks.

``NumericsMonitor(record="run_dir")`` (``run --numerics --record DIR``) watches the recorded steps every module
and hands each one's statistics to :class:`~.store.TimelineWriter` (:mod:`.collect` gathers them on the device,
no host read); the writer appends them to ``run_dir/rank<r>/`` every ``record_flush`` recorded steps with one host
read, and before a ``NonFiniteError`` is raised, and as the monitor closes. :mod:`.store` also reads a run back.
"""
