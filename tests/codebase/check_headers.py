#!/usr/bin/env python3
"""The three kinds of header stay apart (docs/architecture.md, "Headers").

    python3 tests/codebase/check_headers.py [--installed DIR] [--backend-installed DIR]

The tree says which kind a header of lib/ is:
  public     lib/*.h, lib/model/, lib/integrity/, lib/layout/, lib/control/*.h,
             lib/adapters/
  backend    lib/backend/
  internal   lib/internal/, lib/control/internal/
  (lib/cuda/ and lib/torch/ are optional layers on top; examples/, tools/, tests/ and
  python/ are users.)

Dependencies point one way: public core <- backend API <- engines, with the
control plane (lib/control) beside the engines, above the backend. Checks, each
failure named with the file and line:
  * a public header includes only public headers (and system ones);
  * a backend header includes only public and backend headers;
  * a core source (lib/*.cc, model/, integrity/, layout/, internal/) includes only
    public and internal headers: a core file that needs a helper gets it from the
    core, never from backend/;
  * a backend source includes public, backend and internal headers;
  * an internal header includes only public and internal ones;
  * no engine file (engines/**/*.h, *.cc) includes an internal header (lib/internal/,
    lib/control/internal/): an engine built outside this tree gets only the public
    and backend headers (`./refit install --with-backend-api`), so what an engine
    needs of the core's helpers the backend API offers (backend/hex.h);
  * with --installed DIR (what `./refit install --prefix DIR` made): the installed
    headers are exactly the public ones;
  * with --backend-installed DIR (`--with-backend-api`): exactly public + backend.
Exit status 0 when all hold.
"""

import argparse
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
INCLUDE = re.compile(r'^\s*#\s*include\s*<refit/([^>]+)>', re.M)


def kind(rel):
    """The kind of lib/-relative header `rel` ("engine.h", "backend/net.h")."""
    parts = rel.split("/")
    if parts[0] in ("internal",) or rel.startswith("control/internal/"):
        return "internal"
    if parts[0] == "backend":
        return "backend"
    if parts[0] in ("cuda", "torch"):
        return "layer"
    if len(parts) == 1 or parts[0] in ("model", "integrity", "layout", "control", "adapters"):
        return "public"
    return "unknown"


def source_kind(rel):
    """Which layer lib/-relative source `rel` belongs to: core, backend, control or a
    layer (cuda, torch, adapters: users of the core)."""
    parts = rel.split("/")
    if parts[0] == "backend":
        return "backend"
    if parts[0] == "control":
        return "control"
    if parts[0] in ("cuda", "torch", "adapters"):
        return "layer"
    return "core"


def lib_headers():
    out = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "lib")):
        for f in files:
            if f.endswith(".h"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, "lib"))
                out[rel] = kind(rel)
    return out


def includes(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for m in INCLUDE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--installed")
    ap.add_argument("--backend-installed")
    args = ap.parse_args()
    headers = lib_headers()
    problems = []
    for rel, k in sorted(headers.items()):
        if k == "unknown":
            problems.append(f"lib/{rel}: in no folder of a known kind (public, backend/, internal/)")
            continue
        allowed = {"public": {"public"}, "backend": {"public", "backend"}}.get(k)
        if allowed is None:
            continue
        for line, inc in includes(os.path.join(ROOT, "lib", rel)):
            if inc.startswith("engines/"):
                problems.append(f"lib/{rel}:{line}: includes an engine's header <refit/{inc}>")
                continue
            ik = headers.get(inc, "missing")
            if ik not in allowed:
                problems.append(f"lib/{rel}:{line}: a {k} header includes <refit/{inc}> ({ik})")
    # Sources, and the internal headers, by where they live.
    for dirpath, _, files in os.walk(os.path.join(ROOT, "lib")):
        for f in files:
            if not (f.endswith(".cc") or (f.endswith(".h") and headers.get(
                    os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, "lib"))) == "internal")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, "lib"))
            where = source_kind(rel)
            allowed = {"core": {"public", "internal"}, "backend": {"public", "backend", "internal"}}.get(where)
            if allowed is None:
                continue
            for line, inc in includes(os.path.join(ROOT, "lib", rel)):
                ik = headers.get(inc, "missing")
                if inc.startswith("engines/") or ik not in allowed:
                    problems.append(f"lib/{rel}:{line}: {where} code includes <refit/{inc}> ({ik}); "
                                    f"{where} code may include {', '.join(sorted(allowed))} headers")
    for dirpath, _, files in os.walk(os.path.join(ROOT, "engines")):
        for f in files:
            if f.endswith((".cc", ".h", ".cu")):
                p = os.path.join(dirpath, f)
                for line, inc in includes(p):
                    if headers.get(inc) == "internal" or inc.startswith(("internal/", "control/internal/")):
                        problems.append(f"{os.path.relpath(p, ROOT)}:{line}: an engine includes the internal "
                                        f"<refit/{inc}>; engines may include public and backend headers (what "
                                        f"`./refit install --with-backend-api` installs)")
    public = {"refit/" + r for r, k in headers.items() if k == "public"}
    backend = {"refit/" + r for r, k in headers.items() if k == "backend"}
    for flag, expected in ((args.installed, public), (args.backend_installed, public | backend)):
        if not flag:
            continue
        got = set()
        for dirpath, _, files in os.walk(os.path.join(flag, "include")):
            for f in files:
                got.add(os.path.relpath(os.path.join(dirpath, f), os.path.join(flag, "include")))
        for extra in sorted(got - expected):
            problems.append(f"{flag}: installed {extra}, which is not {'public' if expected is public else 'public or backend API'}")
        for missing in sorted(expected - got):
            problems.append(f"{flag}: did not install {missing}")
        print(f"check_headers: {flag}: {len(got)} headers installed, {len(expected)} expected")
    n = {k: sum(1 for v in headers.values() if v == k) for k in ("public", "backend", "internal", "layer")}
    print(f"check_headers: lib/ has {n['public']} public, {n['backend']} backend, {n['internal']} internal headers "
          f"and {n['layer']} in the cuda/torch layers")
    for p in problems:
        print("check_headers: " + p)
    if problems:
        print(f"check_headers: FAILED ({len(problems)} problems)")
        return 1
    print("check_headers: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
