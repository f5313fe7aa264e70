"""python/venv.sh's check of a wheel-building venv (python/requirements-build.txt):
nanobind imports and ships the one translation unit the extension compiles."""
import os
import sys

import nanobind

src = os.path.join(os.path.dirname(nanobind.__file__), "src", "nb_combined.cpp")
if not os.path.exists(src):
    sys.exit(f"nanobind {nanobind.__version__} has no {src}")
print(f"build venv ok: Python {sys.version.split()[0]}, nanobind {nanobind.__version__}")
