"""Stand-in for verl.utils.import_utils (tests/verl/standin/README.md)."""

import importlib


def import_external_libs(external_libs=None):
    if external_libs is None:
        return
    for lib in external_libs if isinstance(external_libs, list) else [external_libs]:
        importlib.import_module(lib)
