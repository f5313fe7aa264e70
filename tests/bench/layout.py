#!/usr/bin/env python3
"""The byte sizes of a model layout, as `weight_sync --print-layout` prints it
({"names": [...], "dtype_names": [...], "shapes": [...]}); shared by the Python
benchmarks. Run as a script, prints the layout's total bytes.

usage: layout.py LAYOUT_JSON
"""
import json
import sys

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def tensor_sizes(layout):
    sizes = []
    for dtype, shape in zip(layout["dtype_names"], layout["shapes"]):
        n = DTYPE_BYTES[dtype]
        for extent in shape:
            n *= extent
        sizes.append(n)
    return sizes


if __name__ == "__main__":
    print(sum(tensor_sizes(json.load(open(sys.argv[1])))))
