"""Session-wide test setup.

Triton kernels run on CPU tensors only under its interpreter, and Triton reads
TRITON_INTERPRET when it is first imported (transformers may import it early), so it is set
here, before any test module loads, on machines without CUDA.
"""

import os
import shutil


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
