"""refit's version in a source tree (python/refit imported without a wheel): the
``version`` of python/pyproject.toml, the one place it is written. An installed
wheel carries it in refit/_build.py instead (build_wheel.py writes it there)."""

import os
import re


def source_tree_version():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "0+unknown"
    # tomllib is Python 3.11+; [project]'s version line is all this needs.
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else "0+unknown"
