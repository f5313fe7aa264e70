"""local_python_repository: the Python headers and nanobind of one interpreter, as
@refit_local_python, for the extension module in //python.

The interpreter is $REFIT_PYTHON when set (refit's scripts set it to the venv that
python/venv.sh makes), else python3 on PATH. nanobind is that interpreter's installed
`nanobind` package (PyPI; not a Debian package): its src/nb_combined.cpp is built
as one translation unit, as nanobind's documentation describes for builds without
CMake. Nothing is downloaded.

Defines:
  @refit_local_python//:nanobind      cc_library (nanobind + the Python headers)
  @refit_local_python//:python_info.txt   the interpreter, its version, what was found
  @refit_local_python//:defs.bzl      PYTHON_FOUND, PYTHON_TAG ("cp311"), EXT_SUFFIX

When no interpreter with nanobind is found the repository still loads, and
:nanobind fails to build with a message saying what to install; nothing else
depends on it (the //python targets are manual).
"""

_PROBE = """
import sys, sysconfig
print(sys.executable)
print(sysconfig.get_paths()["include"])
print("cp%d%d" % sys.version_info[:2])
print(sysconfig.get_config_var("EXT_SUFFIX"))
try:
    import nanobind
    print(nanobind.__file__.rsplit("/", 1)[0])
    print(nanobind.__version__)
except ImportError as e:
    print("")
    print("no nanobind: %s" % e)
"""

_FOUND = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

# nanobind's own code warns under refit's -Wall -Wextra; it is not ours to fix.
cc_library(
    name = "nanobind",
    srcs = ["nanobind/src/nb_combined.cpp"],
    hdrs = glob([
        "nanobind/include/**/*.h",
        "nanobind/src/*.h",
        "nanobind/src/*.cpp",
        "nanobind/ext/robin_map/include/**/*.h",
    ]),
    copts = [
        "-fvisibility=hidden",
        "-fno-strict-aliasing",
        "-w",
    ],
    includes = [
        "nanobind/ext/robin_map/include",
        "nanobind/include",
    ],
    deps = [":python_headers"],
)

exports_files(["python_info.txt"])
"""

_MISSING = """
package(default_visibility = ["//visibility:public"])

genrule(
    name = "missing",
    outs = ["missing.h"],
    cmd = "echo '%s' >&2; exit 1",
)

cc_library(
    name = "nanobind",
    hdrs = [":missing"],
)

exports_files(["python_info.txt"])
"""

def _impl(rctx):
    python = rctx.os.environ.get("REFIT_PYTHON", "")
    if not python:
        found = rctx.which("python3")
        python = str(found) if found else ""
    lines = []
    if python:
        result = rctx.execute([python, "-c", _PROBE], timeout = 120)
        if result.return_code == 0:
            lines = result.stdout.strip().split("\n")
    if len(lines) == 6 and lines[4]:
        executable, include, tag, suffix, nanobind, version = lines
        rctx.symlink(include, "python_include")
        rctx.symlink(nanobind, "nanobind")
        rctx.file("BUILD", _FOUND)
        rctx.file("python_info.txt", "python %s (%s)\ninclude %s\nnanobind %s at %s\n" %
                                     (executable, tag, include, version, nanobind))
        rctx.file("defs.bzl", "PYTHON_FOUND = True\nPYTHON_TAG = %r\nEXT_SUFFIX = %r\n" % (tag, suffix))
        return
    why = "no Python interpreter (REFIT_PYTHON or python3 on PATH)" if not python else (
        "%s: %s" % (python, lines[5] if len(lines) == 6 else "probe failed"))
    message = ("refit's Python module needs an interpreter with nanobind: " + why +
               ". Run python/venv.sh (./refit wheel does) or set REFIT_PYTHON to a python with nanobind==3.1.0.")
    rctx.file("BUILD", _MISSING % message.replace("'", ""))
    rctx.file("python_info.txt", message + "\n")
    rctx.file("defs.bzl", "PYTHON_FOUND = False\nPYTHON_TAG = ''\nEXT_SUFFIX = '.so'\n")

local_python_repository = repository_rule(
    implementation = _impl,
    environ = ["REFIT_PYTHON", "PATH"],
    local = True,
)
