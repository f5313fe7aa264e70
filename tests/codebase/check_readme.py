#!/usr/bin/env python3
"""The README (and the docs) name only what exists.

    python3 tests/codebase/check_readme.py [--status-table FILE]

Checks, each failure named with file and line:
  * README.md has at most 250 lines;
  * every repository path README.md and docs/*.md name (in backticks or links:
    `lib/engine.h`, [x](docs/vllm.md), `tests/bench/netns_scale.sh`) exists;
  * every Bazel label they name (//tests/codebase:status_table) is declared in its
    package's BUILD file;
  * every `./refit CMD` they name is a command of the ./refit script;
  * every --flag they name appears in a source file of the repository (the parser
    or script that takes it), outside the docs;
  * with --status-table FILE (what `bazel run --config=cuda
    //tests/codebase:status_table` printed): README's status table is exactly it.
Exit status 0 when all hold.
"""

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_paths  # noqa: E402  (its ALLOWED list of paths made at run time)

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
TOP = ("lib/", "engines/", "examples/", "tools/", "tests/", "python/", "docs/", "third_party/", ".ci/")
PATH = re.compile(r"(?:`|\]\()((?:\./)?(?:lib|engines|examples|tools|tests|python|docs|third_party|\.ci)/"
                  r"[A-Za-z0-9_./*-]*)")
LINK = re.compile(r"\]\(([A-Za-z0-9_./-]+)(?:#[^)]*)?\)")
LABEL = re.compile(r"(?<![@\w:])//([A-Za-z0-9_/.-]*):([A-Za-z0-9_.+-]+)")
REFIT_CMD = re.compile(r"\./refit ([a-z]+)")
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]+[a-z0-9])")
MAX_README_LINES = 250


def exists(rel):
    if re.search(r"(^|/)[A-Z](/|\.|$)", rel):  # a placeholder: lib/X.h, engines/E/X.h
        return True
    rel = rel.rstrip(".,:;)").replace("./", "", 1) if rel.startswith("./") else rel.rstrip(".,:;)")
    if "*" in rel or rel.endswith("/..."):
        base = rel.split("*")[0].rsplit("/", 1)[0]
        return os.path.isdir(os.path.join(ROOT, base))
    if os.path.exists(os.path.join(ROOT, rel)):
        return True
    # a Bazel output its package declares (tests/cuda/raii_test, as the GPU bundle
    # carries it), or a path check_paths.py allows (one made at run time)
    pkg, _, name = rel.rstrip("/").rpartition("/")
    return bool(name) and label_exists(pkg, name) or check_paths.allowed(rel)


def label_exists(pkg, name):
    build = os.path.join(ROOT, pkg, "BUILD")
    if not os.path.exists(build):
        return False
    text = open(build, encoding="utf-8").read()
    if re.search(r'name = "%s"' % re.escape(name), text):
        return True
    # a file of the package, or a target made by a loop or a macro
    return os.path.exists(os.path.join(ROOT, pkg, name)) or f'"{name}"' in text


def refit_commands():
    text = open(os.path.join(ROOT, "refit"), encoding="utf-8").read()
    return set(re.findall(r"^  ([a-z|]+)\)", text, re.M)[0:0]) | {
        c for group in re.findall(r"^  ([a-z|-]+)\)", text, re.M) for c in group.split("|")}


def source_text():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    chunks = []
    for f in files:
        if f.endswith(".md") or f.startswith("docs/"):
            continue
        if not f.endswith((".cc", ".h", ".py", ".sh", ".bzl", "BUILD", ".bazelrc", "refit", "run", ".txt")):
            continue
        try:
            chunks.append(open(os.path.join(ROOT, f), encoding="utf-8", errors="replace").read())
        except OSError:
            pass
    return "\n".join(chunks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--status-table")
    args = ap.parse_args()
    problems = []
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    n = readme.count("\n")
    if n > MAX_README_LINES:
        problems.append(f"README.md: {n} lines, more than {MAX_README_LINES}")
    docs = ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    commands = refit_commands()
    sources = source_text()
    external_flags = {"weight-transfer-config", "enforce-eager", "max-model-len", "no-deps", "force-reinstall",
                      "target", "dry-run", "output-base", "symlink-prefix", "build-tests-only", "test-output",
                      "find-links", "no-compile", "keep-going"}
    for doc in docs:
        here = os.path.dirname(doc)
        for lineno, line in enumerate(open(os.path.join(ROOT, doc), encoding="utf-8"), 1):
            for m in PATH.finditer(line):
                p = m.group(1)
                if not exists(p):
                    problems.append(f"{doc}:{lineno}: names {p}, which does not exist")
            for m in LINK.finditer(line):
                target = m.group(1)
                if "://" in target or target.startswith("#"):
                    continue
                rel = os.path.normpath(os.path.join(here, target))
                if not os.path.exists(os.path.join(ROOT, rel)):
                    problems.append(f"{doc}:{lineno}: links {target}, which does not exist")
            for m in LABEL.finditer(line):
                pkg, name = m.group(1), m.group(2)
                if pkg.startswith("@") or name in ("all", "*"):
                    continue
                if not label_exists(pkg, name):
                    problems.append(f"{doc}:{lineno}: names //{pkg}:{name}, which no BUILD file declares")
            for m in REFIT_CMD.finditer(line):
                if m.group(1) not in commands:
                    problems.append(f"{doc}:{lineno}: names ./refit {m.group(1)}, not a command of ./refit "
                                    f"({', '.join(sorted(commands))})")
            if doc == "README.md":
                for m in FLAG.finditer(line):
                    flag = m.group(1)
                    if flag in external_flags:
                        continue
                    if not re.search(r"--%s\b" % re.escape(flag), sources) and f'"{flag}"' not in sources:
                        problems.append(f"{doc}:{lineno}: names --{flag}, which no source file takes")
    if args.status_table:
        want = open(args.status_table, encoding="utf-8").read().strip()
        m = re.search(r"<!-- status-table:[^>]*-->\n(.*?)\n<!-- end status-table -->", readme, re.S)
        if not m:
            problems.append("README.md: no status table between its markers")
        elif m.group(1).strip() != want:
            problems.append("README.md: the status table differs from //tests/codebase:status_table's output:\n" + want)
    for p in problems:
        print("check_readme: " + p)
    if problems:
        print(f"check_readme: FAILED ({len(problems)} problems)")
        return 1
    print(f"check_readme: ok (README.md {n} lines; {len(docs)} files checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
