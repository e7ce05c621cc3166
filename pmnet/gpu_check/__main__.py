"""`python -m pmnet.gpu_check` (`make gpu-check`; docs/gpu-check.md)."""

import sys

from pmnet.gpu_check.run import main

sys.exit(main())
