"""local_cuda_repository: the CUDA toolkit and NCCL found on this machine, as @refit_local_cuda.

The toolkit is $CUDA_HOME, else /usr/local/cuda. When it is found, the repository
symlinks its include/ and library directory and defines:

  @refit_local_cuda//:cuda_headers   the toolkit's include/
  @refit_local_cuda//:cudart_static  libcudart_static.a, so binaries need no libcudart.so
  @refit_local_cuda//:nccl           libnccl.so.2, dynamically linked
  @refit_local_cuda//:defs.bzl       CUDA_FOUND, CUDA_HOME, NVCC, CUDA_MISSING_MESSAGE

When it is not found, the repository still loads and defines the same targets, and
building any of them fails with a message that says where it looked. Every target is
also skipped unless --config=cuda, so the default configuration never needs a toolkit.

The rule runs again when CUDA_HOME changes, on `bazel sync --configure`, and once per
Bazel server (local = True), so a toolkit installed later is picked up.
"""

def _absolute(label):
    # "@refit//third_party:cuda_enabled" where refit is a dependency, "@//..." in
    # refit's own workspace: a generated BUILD file must name refit's repository,
    # not the consumer's (where "@//" would point).
    return "@%s//%s:%s" % (label.workspace_name, label.package, label.name)

# Incompatible unless --config=cuda (--define=refit_cuda=1).
_COMPATIBLE = """select({
        "%s": [],
        "//conditions:default": ["%s"],
    })""" % (
    _absolute(Label("//third_party:cuda_enabled")),
    _absolute(Label("//third_party/cuda:incompatible")),
)

def _first_existing(rctx, paths):
    for p in paths:
        if rctx.path(p).exists:
            return p
    return None

def _fail_cmd(message):
    """A genrule cmd that prints message and fails, as a quoted BUILD string."""
    quoted = "'" + ("ERROR: " + message).replace("'", "'\\''").replace("$", "$$") + "'"
    return repr("echo %s >&2; exit 1" % quoted)

def _missing_build(message):
    # Targets exist so that BUILD files referring to them load; each one fails, with
    # the message, only when something actually builds it.
    return """package(default_visibility = ["//visibility:public"])

genrule(
    name = "cuda_missing",
    outs = ["cuda_missing.cc"],
    cmd = {cmd},
    target_compatible_with = {compatible},
)

[cc_library(
    name = n,
    srcs = [":cuda_missing"],
    target_compatible_with = {compatible},
) for n in ["cuda_headers", "cudart_static", "nccl"]]
""".format(cmd = _fail_cmd(message), compatible = _COMPATIBLE)

def _found_build(nccl, nccl_searched):
    build = """package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
    target_compatible_with = {compatible},
)

# cc_import takes no target_compatible_with in Bazel 4; the cc_library wrappers
# carry it.
cc_import(
    name = "cudart_static_archive",
    static_library = "lib64/libcudart_static.a",
)

# The static runtime keeps binaries independent of the libcudart.so version on the
# machine that runs them; only the driver (libcuda.so) is loaded from there.
cc_library(
    name = "cudart_static",
    linkopts = [
        "-ldl",
        "-lpthread",
        "-lrt",
    ],
    target_compatible_with = {compatible},
    deps = [
        ":cuda_headers",
        ":cudart_static_archive",
    ],
)
""".format(compatible = _COMPATIBLE)

    if not nccl:
        return build + """
genrule(
    name = "nccl_missing",
    outs = ["nccl_missing.cc"],
    cmd = {cmd},
    target_compatible_with = {compatible},
)

cc_library(
    name = "nccl",
    srcs = [":nccl_missing"],
    target_compatible_with = {compatible},
)
""".format(
        cmd = _fail_cmd("NCCL not found: no libnccl.so.2 with nccl.h in " + nccl_searched),
        compatible = _COMPATIBLE,
    )

    # cc_import of the file named like its SONAME (libnccl.so.2): Bazel links it from
    # its _solib directory with a $ORIGIN-relative rpath, so tests find it in their
    # runfiles, and a binary copied to another machine finds that machine's NCCL
    # through LD_LIBRARY_PATH or the default search path. No absolute rpath.
    return build + """
cc_import(
    name = "nccl_shared",
    shared_library = "nccl/{soname}",
)

cc_library(
    name = "nccl",
    hdrs = ["nccl/include/nccl.h"],
    includes = ["nccl/include"],
    target_compatible_with = {compatible},
    deps = [
        ":cuda_headers",
        ":nccl_shared",
    ],
)
""".format(soname = nccl.soname, compatible = _COMPATIBLE)

def _nccl_locations(cuda_include, cuda_lib):
    # NCCL ships inside the toolkit tree (pip-assembled toolkits, NVIDIA's tarballs)
    # or as distribution packages (libnccl2 and libnccl-dev).
    return [
        (cuda_lib, cuda_include),
        ("/usr/lib/x86_64-linux-gnu", "/usr/include"),
        ("/usr/lib/aarch64-linux-gnu", "/usr/include"),
    ]

def _find_nccl(rctx, locations):
    """Returns struct(soname, lib, header) for the first NCCL found, or None."""
    for lib_dir, include_dir in locations:
        header = include_dir + "/nccl.h"
        for soname in ["libnccl.so.2", "libnccl.so"]:
            lib = lib_dir + "/" + soname
            if rctx.path(lib).exists and rctx.path(header).exists:
                return struct(soname = soname, lib = lib, header = header)
    return None

def _impl(rctx):
    home = rctx.os.environ.get("CUDA_HOME", "").rstrip("/") or "/usr/local/cuda"
    nvcc = home + "/bin/nvcc"
    include = home + "/include"
    lib = _first_existing(rctx, [
        home + "/lib64/libcudart_static.a",
        home + "/lib/libcudart_static.a",
    ])

    missing = [
        p
        for p, ok in [
            (nvcc, rctx.path(nvcc).exists),
            (include + "/cuda_runtime.h", rctx.path(include + "/cuda_runtime.h").exists),
            (home + "/lib64/libcudart_static.a (or lib/)", lib != None),
        ]
        if not ok
    ]
    if missing:
        message = ("CUDA toolkit not found at %s (missing %s); set CUDA_HOME to the " +
                   "toolkit directory, or build without --config=cuda") % (home, ", ".join(missing))
        rctx.file("BUILD", _missing_build(message))
        rctx.file("defs.bzl", "\n".join([
            "CUDA_FOUND = False",
            "CUDA_HOME = %r" % home,
            "NVCC = %r" % nvcc,
            "CUDA_MISSING_MESSAGE = %r" % message,
            "",
        ]))
        return

    lib_dir = lib.rpartition("/")[0]
    rctx.symlink(include, "include")
    rctx.symlink(lib_dir, "lib64")

    locations = _nccl_locations(include, lib_dir)
    nccl = _find_nccl(rctx, locations)
    if nccl:
        rctx.symlink(nccl.lib, "nccl/" + nccl.soname)
        rctx.symlink(nccl.header, "nccl/include/nccl.h")
    searched = ", ".join(["%s + %s" % (l, i) for l, i in locations])
    rctx.file("BUILD", _found_build(nccl, searched))
    rctx.file("defs.bzl", "\n".join([
        "CUDA_FOUND = True",
        "CUDA_HOME = %r" % home,
        "NVCC = %r" % nvcc,
        "CUDA_MISSING_MESSAGE = ''",
        "",
    ]))

local_cuda_repository = repository_rule(
    implementation = _impl,
    environ = ["CUDA_HOME"],
    configure = True,
    local = True,
)
