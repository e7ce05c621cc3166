"""`python -m pmnet.gpu_check`: the older name of `python -m pmnet.gpu.check` (issue 47 moved
the check into `pmnet.gpu`, next to the footprint it verifies); kept because the docs and
images before it name this one."""

import sys

from pmnet.gpu.check import main

if __name__ == "__main__":
    sys.exit(main())
