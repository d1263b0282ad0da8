"""``python3 -m hf2q_mlx ...``: the same entry point as the ``hf2q-mlx`` command."""

import sys

from hf2q_mlx.cli import main

sys.exit(main())
