"""local_torch_repository: libtorch found on this machine, as @refit_local_torch.

Looked for, in order:
  1. $REFIT_LIBTORCH: a libtorch directory with include/ and lib/ (the C++
     distribution, or any torch wheel's torch/ directory). When set, it is the only
     candidate: a wrong path is reported rather than silently replaced.
  2. The `torch` wheel of python3 on PATH, then of /usr/bin/python3: its torch/include
     and torch/lib are a full libtorch. Debian's python3-torch ships no headers and
     does not count.
  3. Debian's libtorch-dev: headers under /usr/include, libraries in the multiarch
     library directory.

Defines:
  @refit_local_torch//:libtorch            cc_library to depend on
  @refit_local_torch//:libtorch_info.txt   which libtorch was used, and what was tried
  @refit_local_torch//:defs.bzl            LIBTORCH_FOUND, LIBTORCH_SOURCE

When none is found, the repository still loads and :libtorch fails to build, with a
message saying how to provide one; builds that do not depend on it are unaffected.
The rule runs again when REFIT_LIBTORCH or PATH changes, on `bazel sync --configure`,
and once per Bazel server (local = True).
"""

_PROBE = """
import os, torch
print(os.path.dirname(torch.__file__))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)
"""

_MULTIARCH_LIB_DIRS = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]

def _exists(rctx, path):
    return rctx.path(path).exists

def _libtorch_dir(rctx, root):
    """A candidate with include/ and lib/, as struct, or a string saying what is missing."""
    missing = [
        p
        for p in [root + "/include/torch", root + "/lib/libtorch.so", root + "/lib/libc10.so"]
        if not _exists(rctx, p)
    ]
    if missing:
        return "missing " + ", ".join(missing)

    # libtorch.so itself is nearly empty: the operators live in libtorch_cpu (and
    # libtorch_cuda), which register them from static initializers, so they must be
    # linked even though no symbol of theirs is referenced (--no-as-needed below).
    libs = ["torch"] + [
        l
        for l in ["torch_cpu", "torch_cuda", "c10_cuda"]
        if _exists(rctx, "%s/lib/lib%s.so" % (root, l))
    ] + ["c10"]
    return struct(root = root, libs = libs)

def _cmake_cxx11_abi(rctx, root):
    """The _GLIBCXX_USE_CXX11_ABI that libtorch's CMake config asks of dependents, or None."""
    config = rctx.path(root + "/share/cmake/Torch/TorchConfig.cmake")
    if not config.exists:
        return None
    text = rctx.read(config)
    key = "-D_GLIBCXX_USE_CXX11_ABI="
    i = text.find(key)
    value = text[i + len(key):i + len(key) + 1] if i >= 0 else ""
    return value if value in ("0", "1") else None

def _from_env(rctx, tried):
    root = rctx.os.environ.get("REFIT_LIBTORCH", "").rstrip("/")
    found = _libtorch_dir(rctx, root)
    if type(found) == "string":
        tried.append("REFIT_LIBTORCH=%s: %s" % (root, found))
        return None
    return struct(
        source = "REFIT_LIBTORCH",
        version = "",
        cxx11_abi = _cmake_cxx11_abi(rctx, root),
        root = found.root,
        libs = found.libs,
    )

def _from_wheel(rctx, tried):
    pythons = []
    for python in [rctx.which("python3"), rctx.path("/usr/bin/python3")]:
        if python and python.exists and str(python) not in pythons:
            pythons.append(str(python))
    if not pythons:
        tried.append("python3: not on PATH, no /usr/bin/python3")
    for python in pythons:
        result = rctx.execute([python, "-c", _PROBE], timeout = 120)
        if result.return_code != 0:
            lines = result.stderr.strip().splitlines()
            why = lines[-1] if lines else "exit status %d" % result.return_code
            tried.append("%s: import torch failed: %s" % (python, why))
            continue
        lines = result.stdout.strip().splitlines()
        if len(lines) < 3:
            tried.append("%s: unexpected output from the torch probe: %r" % (python, result.stdout))
            continue
        if lines[0].startswith("/usr/lib/python3/dist-packages/"):
            # Debian's python3-torch: its include/ and lib/ are symlinks into
            # libtorch-dev, which is found below as what it is.
            tried.append("%s: torch %s at %s is Debian's python3-torch, not a wheel" %
                         (python, lines[2], lines[0]))
            continue
        found = _libtorch_dir(rctx, lines[0])
        if type(found) == "string":
            tried.append("%s: torch %s at %s is not a wheel with libtorch (%s)" %
                         (python, lines[2], lines[0], found))
            continue
        return struct(
            source = "torch wheel of " + python,
            version = lines[2],
            cxx11_abi = lines[1],
            root = found.root,
            libs = found.libs,
        )
    return None

def _from_debian(rctx, tried):
    api = "/usr/include/torch/csrc/api/include"
    lib_dirs = [d for d in _MULTIARCH_LIB_DIRS if _exists(rctx, d + "/libtorch.so")]
    if not lib_dirs:
        tried.append("libtorch-dev: no libtorch.so in " + ", ".join(_MULTIARCH_LIB_DIRS))
        return None
    lib_dir = lib_dirs[0]
    missing = [
        p
        for p in [
            api + "/torch/torch.h",
            "/usr/include/ATen/ATen.h",
            lib_dir + "/libtorch_cpu.so",
            lib_dir + "/libc10.so",
        ]
        if not _exists(rctx, p)
    ]
    if missing:
        tried.append("libtorch-dev: missing " + ", ".join(missing))
        return None
    return struct(source = "Debian libtorch-dev", api_include = api, lib_dir = lib_dir)

def _build_dir(found):
    # The headers are declared (globbed through the include/ symlink) because Bazel
    # rejects #includes of undeclared files outside the system include directories.
    defines = []
    if found.cxx11_abi != None:
        defines.append("_GLIBCXX_USE_CXX11_ABI=%s" % found.cxx11_abi)
    linkopts = ["-L" + found.root + "/lib"]

    # The wheel's libraries find each other (and their bundled libgomp etc.) through
    # their own $ORIGIN rpaths, which only works when they are loaded from their real
    # directory: hence -rpath to it rather than copies in Bazel's _solib.
    linkopts.append("-Wl,-rpath," + found.root + "/lib")
    linkopts.append("-Wl,--no-as-needed")
    linkopts += ["-l" + l for l in found.libs]
    linkopts.append("-Wl,--as-needed")
    return """package(default_visibility = ["//visibility:public"])

exports_files(["libtorch_info.txt"])

cc_library(
    name = "libtorch",
    hdrs = glob(["include/**"]),
    defines = {defines},
    includes = [
        "include",
        "include/torch/csrc/api/include",
    ],
    linkopts = {linkopts},
)
""".format(defines = repr(defines), linkopts = repr(linkopts))

def _build_debian(found):
    # ATen, c10 and torch/ live in /usr/include, which the toolchain already searches;
    # only the C++ frontend's directory needs adding, and declaring (symlinked here).
    return """package(default_visibility = ["//visibility:public"])

exports_files(["libtorch_info.txt"])

cc_library(
    name = "libtorch",
    hdrs = glob(["api_include/**"]),
    includes = ["api_include"],
    linkopts = {linkopts},
)
""".format(linkopts = repr(["-L" + found.lib_dir, "-Wl,--no-as-needed", "-ltorch", "-ltorch_cpu", "-lc10", "-Wl,--as-needed"]))

def _build_missing(message):
    quoted = "'" + message.replace("'", "'\\''").replace("$", "$$") + "'"
    return """package(default_visibility = ["//visibility:public"])

exports_files(["libtorch_info.txt"])

genrule(
    name = "libtorch_missing",
    outs = ["libtorch_missing.cc"],
    cmd = {cmd},
)

# Fails when built, never when merely referenced.
cc_library(
    name = "libtorch",
    srcs = [":libtorch_missing"],
)
""".format(cmd = repr("printf '%s\\n' " + quoted + " >&2; exit 1"))

def _impl(rctx):
    tried = []
    if rctx.os.environ.get("REFIT_LIBTORCH"):
        found = _from_env(rctx, tried)
    else:
        found = _from_wheel(rctx, tried) or _from_debian(rctx, tried)

    if not found:
        message = "\n".join([
            "ERROR: libtorch not found. Tried:",
        ] + ["  - " + t for t in tried] + [
            "Provide it in one of these ways, then run `bazel sync --configure`:",
            "  - export REFIT_LIBTORCH=/path/to/libtorch   (a directory with include/ and lib/)",
            "  - pip install torch                         (python3 on PATH)",
            "  - apt-get install libtorch-dev              (Debian)",
        ])
        rctx.file("libtorch_info.txt", message + "\n")
        rctx.file("BUILD", _build_missing(message))
        rctx.file("defs.bzl", "LIBTORCH_FOUND = False\nLIBTORCH_SOURCE = ''\n")
        return

    info = ["source: " + found.source]
    if hasattr(found, "root"):
        rctx.symlink(found.root + "/include", "include")
        info.append("root: " + found.root)
        if found.version:
            info.append("version: " + found.version)
        if found.cxx11_abi != None:
            info.append("_GLIBCXX_USE_CXX11_ABI: " + found.cxx11_abi)
        if found.cxx11_abi == "0":
            info.append(
                "note: this libtorch uses the pre-C++11 libstdc++ ABI. Code passing std:: " +
                "types to or through it must match: add `build " +
                "--copt=-D_GLIBCXX_USE_CXX11_ABI=0` to user.bazelrc.",
            )
        info.append("libraries: " + " ".join(found.libs))
        rctx.file("BUILD", _build_dir(found))
    else:
        rctx.symlink(found.api_include, "api_include")
        info.append("headers: /usr/include, " + found.api_include)
        info.append("libraries: %s/libtorch.so libtorch_cpu.so libc10.so" % found.lib_dir)
        rctx.file("BUILD", _build_debian(found))
    info += ["passed over: " + t for t in tried]
    rctx.file("libtorch_info.txt", "\n".join(info) + "\n")
    rctx.file("defs.bzl", "LIBTORCH_FOUND = True\nLIBTORCH_SOURCE = %r\n" % found.source)

local_torch_repository = repository_rule(
    implementation = _impl,
    environ = ["REFIT_LIBTORCH", "PATH"],
    configure = True,
    local = True,
)
