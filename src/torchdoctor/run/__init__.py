"""``torchdoctor run -- CMD``: run a training command, watch it, and give one verdict on how it ended.

Outside the command (this folder): :mod:`.command` is the CLI (arguments, usage errors, the report);
:mod:`.supervisor` runs the command and collects the result, with :mod:`.process` (the child, its process group,
signals, memory samples) and :mod:`.pump` (its output passed through, decoded and fed to the log analyzer of
:mod:`torchdoctor.logs`); :mod:`.result` is the data collected, :mod:`.exit_findings` judges how the process ended,
:mod:`.numerics_verdict` reads the numerics monitor's reports into one ``numerics.nonfinite`` finding;
:mod:`.switch` (``--numerics``) and :mod:`.flight` (the Flight Recorder) set the command's start-up environment.

Inside the command's processes: :mod:`.inside`, the start-up bootstrap (``inside/boot/sitecustomize.py`` on
``PYTHONPATH``) that attaches the numerics monitor and arms the Flight Recorder hook.

This package imports nothing at start-up: the bootstrap imports :mod:`.inside` in every process of the command.
"""
