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

It runs on every CPython the package supports (3.10 to 3.13): on 3.10, which has
no tomllib, read_toml() reads pyproject.toml.
"""

import argparse
import ast
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def read_project():
    """python/pyproject.toml's [project] table."""
    with open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)["project"]
    return read_toml(text)["project"]


# A token of pyproject.toml's TOML (space and comments are dropped by read_toml).
_TOKEN = re.compile(r"""[ \t\r]+|\#[^\n]*|(?P<t>\n|"(?:[^"\\\n]|\\.)*"|'[^'\n]*'|[A-Za-z0-9_+-]+|[=,.\[\]])""")


def read_toml(text):
    """The document ``text`` as tomllib.loads() reads it, for CPython 3.10 (no
    tomllib) and the TOML pyproject.toml is written in: [tables] and [[arrays of
    tables]] (bare, "quoted" and dotted keys), ``key = value`` where value is a
    string ("basic" or 'literal', one line), true, false, an integer or an array of
    them (over lines, with comments). Anything else raises ValueError."""
    statements, tokens, depth, pos = [], [], 0, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"pyproject.toml: TOML build_wheel.py cannot read, at {text[pos:pos + 40]!r}")
        token, pos = m["t"], m.end()
        if token == "\n" and depth == 0:
            statements += [tokens] if tokens else []
            tokens = []
        elif token is not None and token != "\n":
            depth += {"[": 1, "]": -1}.get(token, 0)
            tokens.append(token)
    statements += [tokens] if tokens else []

    def literal(token):  # a Python literal of the same value
        if token[0] == "'":
            return repr(token[1:-1])
        return {"true": "True", "false": "False"}.get(token, token)

    def path(tokens):  # a dotted key's parts
        if len(tokens) % 2 == 0 or any(t != "." for t in tokens[1::2]):
            raise ValueError(f"pyproject.toml: not a key: {' '.join(tokens)}")
        return [ast.literal_eval(literal(t)) if t[0] in "\"'" else t for t in tokens[::2]]

    def table_at(parts, root):  # the table at parts (the last of an array of tables)
        for part in parts:
            root = root.setdefault(part, {})
            root = root[-1] if isinstance(root, list) else root
        return root

    document = {}
    table = document
    for tokens in statements:
        if tokens[0] == "[":  # [table] or [[array of tables]]
            many = tokens[1] == "["
            parts = path(tokens[1 + many:-1 - many])
            if many:
                table = table_at(parts[:-1], document).setdefault(parts[-1], [])
                table.append({})
                table = table[-1]
            else:
                table = table_at(parts, document)
            continue
        if "=" not in tokens:
            raise ValueError(f"pyproject.toml: neither a table nor key = value: {' '.join(tokens)}")
        eq = tokens.index("=")
        parts = path(tokens[:eq])
        try:
            value = ast.literal_eval(" ".join(literal(t) for t in tokens[eq + 1:]))
        except (SyntaxError, ValueError):
            raise ValueError(f"pyproject.toml: a value build_wheel.py cannot read: {' '.join(tokens)}") from None
        table_at(parts[:-1], table)[parts[-1]] = value
    return document


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
