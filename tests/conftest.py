"""Shared test setup.

Triton kernels run under the interpreter on machines without a GPU (CI has none). The variable
must be set before anything imports triton, so it is set here, before any test module loads;
export TRITON_INTERPRET=0 to run the kernel tests compiled on a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
