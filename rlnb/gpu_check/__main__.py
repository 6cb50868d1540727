"""``python -m rlnb.gpu_check``: see :mod:`rlnb.gpu_check`."""

import sys

from rlnb.gpu_check import main

sys.exit(main())
