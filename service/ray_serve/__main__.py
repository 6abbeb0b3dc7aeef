"""``python -m service.ray_serve``: the ``kda-serve-ray`` command."""
import sys

from .cli import main

sys.exit(main())
