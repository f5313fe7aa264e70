"""The GPU check's UCX venv works: libucx-cu13 holds the libraries and CUDA
transport modules tests/cuda/gpu_bundle.sh copies into the bundle."""
import os

import libucx

lib = os.path.join(os.path.dirname(libucx.__file__), "lib")
for name in ("libucp.so.0", "libucs.so.0", "libuct.so.0", "libucm.so.0", "ucx/libuct_cuda.so.0"):
    assert os.path.exists(os.path.join(lib, name)), f"libucx-cu13 has no {name} under {lib}"
print("ucx venv ok")
