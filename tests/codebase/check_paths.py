#!/usr/bin/env python3
"""Comments and docs name only repository paths that exist.

    python3 tests/codebase/check_paths.py [-v]

Reads the comments of C/C++/CUDA sources (// and /* */), of Starlark and Python
files (# comments, docstrings), of shell scripts, .bazelrc, TOML and requirement
files, and the whole text of the Markdown files (CHANGELOG.md aside: it tells
history, and its paths may be old). In that text it finds

  * repository paths: a token that starts with a top-level folder (lib/, engines/,
    examples/, tools/, tests/, third_party/, python/, docs/, .ci/), e.g.
    `engines/tcp/tcp.h`, `tests/fuzz/corpus/*/`, `tests/cuda/...`;
  * Bazel labels: //lib:core, @refit//:refit, //tests/cuda:raii_test, //engines/tcp;
    the package must have a BUILD file that declares the target;
  * refit's include paths: <refit/X> is lib/X, <refit/engines/E/X> is engines/E/X
    (the include prefixes third_party/refit.bzl sets);
  * Markdown links to files ([x](engines.md)), relative to the linking file;
  * bare file names of the kinds the root holds (README.md, building.md,
    ruff.toml, .bazelrc, .clang-format, repositories.bzl), which must exist at the
    root, beside the naming file or in docs/ (pyproject.toml aside: python/'s or
    another project's).

A path names something that exists when it is a file or folder of the working
tree (tracked, or new and not ignored), a glob that matches one, or a Bazel output
(tests/cuda/raii_test: the package tests/cuda declares raii_test). Not checked:
placeholders (lib/X.h, engines/<name>/, tests/cuda/cpXY), paths git ignores (what
builds and scripts write: tests/consumer/bazel-*), paths after a `/` (runtime and
install paths: /tmp/..., $ROOT/lib, site-packages/...) and the few ALLOWED below.
Standard library only; reads the working tree as git lists it (so a file moved but
not yet committed counts where it is now).

Prints `check_paths: N references in M files, all exist`, or one line per missing
path (file:line: the path) and exits with status 1.
"""

import argparse
import fnmatch
import io
import os
import re
import subprocess
import sys
import tokenize

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
TOP_DIRS = ("lib", "engines", "examples", "tools", "tests", "third_party", "python", "docs", ".ci")

# Paths that do not exist in a checkout on purpose. Keep this short; each entry
# says why it is not a stale reference. An entry covers what lies under it.
ALLOWED = (
    # Where GPU-check reports are committed (tests/cuda/gpu_check.sh's summary);
    # status_table.cc reads the folder when present, and none is committed yet.
    "tests/cuda/reports",
    # vLLM's own tests, in vLLM's source tree, which tests/python/run_vllm_own_tests.sh
    # runs against refit's backend (and test_vllm_conformance.py cites).
    "tests/distributed",
    "tests/v1",
    "tests/conftest.py",
)

# A path: a top-level folder, then path characters. Not after a word character, a
# `/`, `.`, `-`, `$` or `:` (so /usr/lib/x, $ROOT/tests/x, refit/lib/x, a URL's
# path and a label's package are left to their own rules).
PATH = re.compile(r"(?<![\w/.$:@-])(?:\./)?((?:%s)/[A-Za-z0-9_.*/+-]*)" %
                  "|".join(re.escape(d) for d in TOP_DIRS))
# A label: //pkg:name, //pkg, @refit//pkg:name; not a URL's // (after a `:`) and not
# a comment's // (followed by a space).
LABEL = re.compile(r"(?<![\w:/])(@[\w.-]+)?//([A-Za-z0-9_/.-]*)(?::([A-Za-z0-9_.+/=-]+))?")
INCLUDE = re.compile(r"<(refit/[A-Za-z0-9_./-]+)>")
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# Bare file names (no folder part) of the kinds the root holds: README.md,
# building.md, ruff.toml, .bazelrc, repositories.bzl.
BARE = re.compile(r"(?<![\w/.$:@<-])([A-Za-z0-9_-]+\.md|[A-Za-z0-9_-]+\.toml|\.bazelrc|\.bazelignore|"
                  r"\.clang-format|repositories\.bzl)(?![\w/-])")

C_LIKE = (".cc", ".h", ".cu", ".cuh", ".cpp", ".c", ".hpp")
STARLARK = (".bzl",)
STARLARK_NAMES = ("BUILD", "WORKSPACE", "BUILD.bazel")
HASH_COMMENTS = (".sh", ".bazelrc", ".toml", ".txt")
SKIP_PREFIXES = ("tests/fuzz/corpus/",)  # fuzz inputs, not text


def repo_files():
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    files = sorted({f for f in out.split("\0") if f and os.path.isfile(os.path.join(ROOT, f))})
    dirs = {""}
    for f in files:
        parts = f.split("/")
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
    return files, dirs


def shebang_shell(path):
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and (b"sh" in first.split(b"/")[-1])


# ---- comment extraction: each returns [(line number, text)] ----

def c_comments(text):
    """// and /* */ comments of C, C++ and CUDA, skipping string and character
    literals (raw strings too) and digit separators (1'000)."""
    out, i, n, line = [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((line, text[i + 2:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j
            for k, part in enumerate(text[i + 2:j].split("\n")):
                out.append((line + k, part))
            line += text.count("\n", i, j)
            i = j + 2
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
                                                        or text[i - 2:i] in ("u8",) or text[i - 1] in "uUL"):
            m = re.match(r'R"([^()\\\s]{0,16})\(', text[i:])
            if not m:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            end = n if end < 0 else end + len(m.group(1)) + 2
            line += text.count("\n", i, end)
            i = end
        elif c == '"' or (c == "'" and not (i and (text[i - 1].isalnum() or text[i - 1] == "_"))):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def python_comments(text):
    """# comments and docstrings (a string that is a statement of its own) of Python
    and Starlark; None when the file does not tokenize."""
    out = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    prev = tokenize.NEWLINE
    for k, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                      tokenize.NL, tokenize.ENCODING):
            nxt = next((t for t in tokens[k + 1:] if t.type not in (tokenize.COMMENT,)), None)
            if nxt is None or nxt.type in (tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.NL):
                for j, part in enumerate(tok.string.split("\n")):
                    out.append((tok.start[0] + j, part))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def hash_comments(text):
    """# comments of shell, .bazelrc, TOML and requirement files: a # at the start of
    a line or after a blank, outside quotes on its line (${#x} and "$#" stay code)."""
    out = []
    for lineno, line in enumerate(text.split("\n"), 1):
        quote = None
        for i, c in enumerate(line):
            if quote:
                if c == "\\" and quote == '"':
                    continue
                if c == quote:
                    quote = None
            elif c in "'\"":
                quote = c
            elif c == "#" and (i == 0 or line[i - 1] in " \t;"):
                out.append((lineno, line[i + 1:]))
                break
    return out


def text_lines(path, rel):
    """The commented (or documenting) lines of a file, or None when it is not
    checked."""
    if rel.startswith(SKIP_PREFIXES) or rel == "CHANGELOG.md":
        return None
    base = os.path.basename(rel)
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
        return None
    if rel.endswith(".md"):
        return list(enumerate(text.split("\n"), 1))
    if rel.endswith(C_LIKE):
        return c_comments(text)
    if rel.endswith(".py") or rel.endswith(STARLARK) or base in STARLARK_NAMES:
        got = python_comments(text)
        return got if got is not None else hash_comments(text)
    if rel.endswith(HASH_COMMENTS) or base == "CMakeLists.txt" or shebang_shell(path):
        return hash_comments(text)
    return None


# ---- existence ----

class Tree:
    def __init__(self, files, dirs):
        self.files, self.dirs = set(files), dirs
        self.all = sorted(self.files | dirs)
        self.builds = {}

    def exists(self, rel):
        rel = rel.rstrip("/")
        return rel in self.files or rel in self.dirs

    def build_text(self, pkg):
        if pkg not in self.builds:
            text = None
            for name in ("BUILD", "BUILD.bazel"):
                p = os.path.join(pkg, name) if pkg else name
                if p in self.files:
                    text = open(os.path.join(ROOT, p), encoding="utf-8").read()
            self.builds[pkg] = text
        return self.builds[pkg]

    def declares(self, pkg, name):
        """Whether package `pkg` has a target `name`: declared by name, a file of
        the package, or a name a loop or macro of its BUILD builds ("name")."""
        text = self.build_text(pkg)
        if text is None:
            return False
        if self.exists(f"{pkg}/{name}" if pkg else name):
            return True
        return re.search(r'name\s*=\s*"%s"' % re.escape(name), text) is not None or f'"{name}"' in text

    def glob(self, pattern):
        pattern = pattern.rstrip("/")
        return any(fnmatch.fnmatchcase(p, pattern) for p in self.all)


def placeholder(rel):
    """A stand-in, not a path: lib/X.h, engines/E/X.h, lib/cuda/x.cc, tests/x:y_test,
    netns_delta_F.json; a CPython tag (python/cp312, cpXY: a folder made
    per interpreter); prose such as "lib/-relative"."""
    for part in rel.split("/"):
        stem = part.split(".")[0]
        if part.startswith("-") or re.fullmatch(r"cp(\d+|XY)", stem):
            return True
        if stem in ("BUILD", "README", "WORKSPACE", "LICENSE", "CHANGELOG", "CONTRIBUTING"):
            continue
        if re.fullmatch(r"[A-Za-z]|[A-Z]{2}|[a-z]*XY?|[a-z0-9_]+_[A-Z]", stem):
            return True
    return False


def allowed(rel):
    rel = rel.rstrip("/")
    return any(rel == a or rel.startswith(a + "/") for a in ALLOWED)


def check_path(tree, rel):
    """None when `rel` (a path relative to the root) names something that exists,
    else the reason."""
    rel = rel.rstrip(".,;:'`-")
    if rel.endswith("/...") or "/.../" in rel:  # a Bazel pattern, or an elision
        rel = rel.split("/...")[0]
    rel = rel.rstrip(".")
    if not rel or placeholder(rel) or allowed(rel):
        return None
    if "*" in rel:
        return None if tree.glob(rel) else "matches nothing"
    if tree.exists(rel):
        return None
    # a Bazel output, as bazel-bin and the GPU bundle hold it: tests/cuda/raii_test
    pkg, _, name = rel.rstrip("/").rpartition("/")
    if name and "." not in name and tree.declares(pkg, name):
        return None
    return "does not exist"


def check_label(tree, repo, pkg, name):
    if repo and repo != "@refit":
        return None
    if not pkg and not name:
        return None
    if pkg and pkg.split("/")[0] not in TOP_DIRS:
        return None
    pkg = pkg.rstrip("/")
    if name:
        name = name.rstrip(".,;:")
    if placeholder(pkg) or name and placeholder(name):
        return None
    if pkg.endswith("/...") or pkg == "...":
        pkg = pkg[:-4] if pkg != "..." else ""
        return None if tree.exists(pkg) else "no such package folder"
    if tree.build_text(pkg) is None:
        return "no BUILD file in " + (pkg or "the root")
    if not name:  # //python: the package itself
        return None
    if name in ("all", "*", "__pkg__", "__subpackages__") or name.startswith("all-"):
        return None
    return None if tree.declares(pkg, name) else "its BUILD file declares no " + name


def check_include(tree, inc):
    rest = inc[len("refit/"):]
    rel = rest if rest.startswith("engines/") else "lib/" + rest
    if rel.endswith("/...") or rel == "lib/...":  # <refit/...>, <refit/internal/...>
        rel = rel[:-4]
    ok = tree.exists(rel) or placeholder(rel) or ("*" in rel and tree.glob(rel))
    return None if ok else "not " + rel


def scan(tree, rel, lines, ignored_check):
    refs, problems = 0, []
    here = os.path.dirname(rel)
    for lineno, line in lines:
        found = []  # (what it was written as, reason or None)
        for m in LABEL.finditer(line):
            repo, pkg, name = m.group(1), m.group(2), m.group(3)
            if (not pkg and not name) or (pkg and pkg.split("/")[0] not in TOP_DIRS):
                continue
            if repo and repo != "@refit":
                continue
            found.append((m.group(0), check_label(tree, repo, pkg, name)))
        labels = [m.span() for m in LABEL.finditer(line)]
        for m in PATH.finditer(line):
            if any(a <= m.start() < b for a, b in labels):
                continue
            p = m.group(1)
            found.append((p, check_path(tree, p), p))
        for m in INCLUDE.finditer(line):
            found.append((f"<{m.group(1)}>", check_include(tree, m.group(1))))
        if rel.endswith(".md"):
            for m in MD_LINK.finditer(line):
                target = m.group(1)
                if "://" in target or target.startswith(("mailto:", "/")):
                    continue
                p = os.path.normpath(os.path.join(here, target))
                if p.startswith(".."):
                    found.append((target, "outside the repository"))
                    continue
                found.append((target, check_path(tree, p), p))
        for m in BARE.finditer(line):
            name = m.group(1)
            if m.start() and line[m.start() - 1] == "/":
                continue
            if name == "pyproject.toml":  # python/'s, or some other project's: ambiguous
                continue
            spots = [name, os.path.join(here, name), os.path.join("docs", name)]
            ok = any(tree.exists(s) for s in spots) or placeholder(name)
            found.append((name, None if ok else "no such file at the root, beside it or in docs/"))
        seen = set()
        for entry in found:
            refs += 1
            what = entry[0].rstrip(".,;:")
            if entry[1] is not None and what not in seen:
                seen.add(what)
                problems.append((rel, lineno, what, entry[1], entry[2] if len(entry) > 2 else None))
    # what git ignores is written by builds and scripts, not a stale name
    return refs, [p for p in problems if not (p[4] and ignored_check(p[4]))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="list every file checked")
    args = ap.parse_args()
    files, dirs = repo_files()
    tree = Tree(files, dirs)

    cache = {}

    def ignored(rel):
        rel = rel.rstrip("/").split("*")[0].rstrip("/")
        if rel not in cache:
            cache[rel] = subprocess.run(["git", "check-ignore", "-q", "--no-index", rel], cwd=ROOT).returncode == 0
        return cache[rel]

    total_refs, n_files, problems = 0, 0, []
    for rel in files:
        lines = text_lines(os.path.join(ROOT, rel), rel)
        if lines is None:
            continue
        n_files += 1
        if args.verbose:
            print("check_paths: reading " + rel)
        refs, probs = scan(tree, rel, lines, ignored)
        total_refs += refs
        problems += probs
    for rel, lineno, what, why, _ in problems:
        print(f"{rel}:{lineno}: {what}: {why}")
    if problems:
        print(f"check_paths: FAILED: {len(problems)} of {total_refs} references in {n_files} files name "
              "nothing that exists")
        return 1
    print(f"check_paths: {total_refs} references in {n_files} files, all exist")
    return 0


if __name__ == "__main__":
    sys.exit(main())
