"""``python -m torchdoctor`` is the ``torchdoctor`` command."""

import sys

from .cli import main

try:
    code = main()
except KeyboardInterrupt:  # one that came after main() had returned: still the user's Ctrl-C, not a crash
    code = 130
sys.exit(code)
