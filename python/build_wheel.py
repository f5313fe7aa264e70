"""Builds refit's wheel from the Bazel-built extension and the package sources.

    python build_wheel.py --so bazel-bin/python/_refit.so --out dist [--cuda]

Run by `./refit wheel` with the interpreter the extension was built for (its
version decides the wheel's tags and the extension's file name). No setuptools:
a wheel is a zip with a dist-info folder (PEP 427), written here directly.

The package's metadata (name, version, description, license, requires-python,
dependencies, entry points) is python/pyproject.toml's [project] table, its one
source: the version also goes into refit/_build.py, where refit.__version__ reads
it. The wheel carries the extension's type stubs (refit/_refit.pyi, made here by
nanobind.stubgen from the built extension) and refit/py.typed (PEP 561).
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
import tomllib
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def read_project():
    """python/pyproject.toml's [project] table."""
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def metadata(project, version, description):
    """The wheel's METADATA (core metadata 2.1) from the [project] table."""
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {version}",
        f"Summary: {project['description']}",
        f"License: {project['license']}",
        f"Requires-Python: {project['requires-python']}",
    ]
    lines += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {d}; extra == "{extra}"' for d in deps]
    lines.append("Description-Content-Type: text/markdown")
    return "\n".join(lines) + "\n\n" + description


def entry_points(project):
    """entry_points.txt from [project.entry-points]."""
    out = []
    for group, points in project.get("entry-points", {}).items():
        out.append(f"[{group}]")
        out += [f"{name} = {target}" for name, target in points.items()]
        out.append("")
    return "\n".join(out)


def stubs(package_files):
    """refit/_refit.pyi: nanobind.stubgen run on the built extension, imported as
    refit._refit from a copy of the package as the wheel holds it (private members
    included: the package's wrappers call them)."""
    with tempfile.TemporaryDirectory() as tmp:
        for arc, data in package_files.items():
            path = os.path.join(tmp, arc)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        out = os.path.join(tmp, "_refit.pyi")
        env = dict(os.environ, PYTHONPATH=tmp, PYTHONNOUSERSITE="1")
        subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-P", "-m", "refit._refit", "-o", out],
                       check=True, env=env, cwd=tmp)
        with open(out, "rb") as f:
            return f.read()


def record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--so", required=True, help="the built extension (bazel-bin/python/_refit.so)")
    parser.add_argument("--out", required=True, help="folder for the wheel")
    parser.add_argument("--cuda", action="store_true", help="the extension was built with --config=cuda")
    args = parser.parse_args()

    project = read_project()
    name = project["name"]
    # The CUDA build carries a local version label: both wheels can sit in dist/.
    version = project["version"] + ("+cuda" if args.cuda else "")
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")
    wheel_name = f"{name}-{version}-{tag}-{tag}-{platform}.whl"

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
        f'"""How this wheel was built (written by build_wheel.py)."""\n'
        f"BUILD = {build!r}\nPYTHON = {tag!r}\nVERSION = {version!r}\n"
    ).encode()
    files["refit/_refit.pyi"] = stubs(files)
    files["refit/py.typed"] = b""  # PEP 561: type checkers read the package's annotations and stubs

    dist_info = f"{name}-{version}.dist-info"
    with open(os.path.join(HERE, project["readme"]), encoding="utf-8") as f:
        description = f.read()
    files[f"{dist_info}/METADATA"] = metadata(project, version, description).encode()
    files[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\n"
        "Generator: refit build_wheel.py\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {tag}-{tag}-{platform}\n"
    ).encode()
    files[f"{dist_info}/entry_points.txt"] = entry_points(project).encode()
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
