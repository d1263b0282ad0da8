"""``python -m hf2q_mlx``: the same command line as ``hf2q-mlx``."""

import sys

from .cli import main

sys.exit(main())
