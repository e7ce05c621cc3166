"""`python -m pmnet.gpu_check` (`make gpu-check`; docs/gpu-check.md)."""

import sys

from pmnet.gpu_check.run import main

if __name__ == "__main__":  # importing the module (e.g. walking the package) runs nothing
    sys.exit(main())
