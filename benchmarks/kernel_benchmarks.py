"""Kernel benchmarks: ``python benchmarks/kernel_benchmarks.py [--quick] [--out-dir DIR]``.

A thin entry point; the code lives in ``dcp_compile.kernels.benchmark`` (also reachable as
``python -m dcp_compile bench kernels``).
"""

import sys

from dcp_compile.kernels.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
