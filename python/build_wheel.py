"""Builds refit's wheel from the Bazel-built extension and the package sources.

    python build_wheel.py --so bazel-bin/python/_refit.so --out dist [--cuda]

Run by `./refit wheel` with the interpreter the extension was built for (its
version decides the wheel's tags and the extension's file name). No setuptools:
a wheel is a zip with a dist-info folder (PEP 427), written here directly.
"""

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

NAME = "refit"
VERSION = "0.1.0"
HERE = os.path.dirname(os.path.abspath(__file__))


def record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--so", required=True, help="the built extension (bazel-bin/python/_refit.so)")
    parser.add_argument("--out", required=True, help="folder for the wheel")
    parser.add_argument("--cuda", action="store_true", help="the extension was built with --config=cuda")
    args = parser.parse_args()

    # The CUDA build carries a local version label: both wheels can sit in dist/.
    version = VERSION + ("+cuda" if args.cuda else "")
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")
    wheel_name = f"{NAME}-{version}-{tag}-{tag}-{platform}.whl"

    files = {}  # archive path -> bytes
    package = os.path.join(HERE, "refit")
    for root, _, names in os.walk(package):
        for n in sorted(names):
            if n.endswith(".py"):
                path = os.path.join(root, n)
                arc = os.path.relpath(path, HERE).replace(os.sep, "/")
                with open(path, "rb") as f:
                    files[arc] = f.read()

    # The extension, without its debug information (Bazel builds it with -g1).
    with tempfile.TemporaryDirectory() as tmp:
        stripped = os.path.join(tmp, "_refit.so")
        shutil.copyfile(args.so, stripped)
        os.chmod(stripped, 0o755)
        subprocess.run(["strip", "--strip-debug", stripped], check=True)
        with open(stripped, "rb") as f:
            files[f"refit/_refit{ext_suffix}"] = f.read()

    build = "cuda" if args.cuda else "cpu"
    files["refit/_build.py"] = (
        f'"""How this wheel was built (written by build_wheel.py)."""\nBUILD = {build!r}\nPYTHON = {tag!r}\n'
    ).encode()

    dist_info = f"{NAME}-{version}.dist-info"
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        description = f.read()
    files[f"{dist_info}/METADATA"] = (
        "Metadata-Version: 2.1\n"
        f"Name: {NAME}\n"
        f"Version: {version}\n"
        "Summary: refit's C++ weight-transfer engines for PyTorch trainers and vLLM workers\n"
        f"Requires-Python: =={sys.version_info[0]}.{sys.version_info[1]}.*\n"
        "Requires-Dist: numpy\n"
        "Provides-Extra: torch\n"
        "Requires-Dist: torch; extra == \"torch\"\n"
        "Description-Content-Type: text/markdown\n"
        "\n" + description
    ).encode()
    files[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\n"
        "Generator: refit build_wheel.py\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {tag}-{tag}-{platform}\n"
    ).encode()
    # vLLM finds the backend in every worker through this entry point.
    files[f"{dist_info}/entry_points.txt"] = b"[vllm.general_plugins]\nrefit = refit.vllm:register\n"
    record = [f"{arc},{record_hash(data)},{len(data)}" for arc, data in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()

    os.makedirs(args.out, exist_ok=True)
    target = os.path.join(args.out, wheel_name)
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for arc, data in files.items():
            info = zipfile.ZipInfo(arc, date_time=(2026, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (0o755 if arc.endswith(".so") else 0o644) << 16
            z.writestr(info, data)
    print(target)


if __name__ == "__main__":
    main()
