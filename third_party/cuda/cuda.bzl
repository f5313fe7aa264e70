"""cuda_library: .cu files compiled by nvcc, then linked like any other cc_library.

    load("//third_party/cuda:cuda.bzl", "cuda_library", "cuda_only")

    cuda_library(
        name = "kernels",
        srcs = ["fill.cu"],
        hdrs = ["fill.h"],
        deps = [":cuda"],
    )

    cc_test(..., target_compatible_with = cuda_only())

Bazel 4's C++ rules know no CUDA, so nvcc runs as a plain action and its objects go
into a cc_library's srcs next to the static CUDA runtime. The action is a small rule
rather than a genrule because a rule can read the deps' include paths and defines
(CcInfo); a genrule sees only files. Everything here is skipped unless --config=cuda.
"""

load("@refit_local_cuda//:defs.bzl", "CUDA_FOUND", "CUDA_MISSING_MESSAGE", "NVCC")
load("//third_party:refit.bzl", "refit_include_path", "refit_include_prefix")

# sm_90 machine code for H100/H200, plus compute_90 PTX that the driver can compile
# for later GPUs at load time.
_GENCODE = [
    "-gencode",
    "arch=compute_90,code=sm_90",
    "-gencode",
    "arch=compute_90,code=compute_90",
]

# -fPIC: Bazel links these objects into test shared libraries as well as binaries.
_NVCC_FLAGS = ["-Xcompiler", "-fPIC", "-std=c++20", "-O2"] + _GENCODE

def cuda_only():
    """The target_compatible_with of every target that needs CUDA.

    Under the default configuration such targets are skipped by `//...` patterns
    (and refused when named explicitly); --config=cuda enables them.
    """
    return select({
        "//third_party:cuda_enabled": [],
        "//conditions:default": ["//third_party/cuda:incompatible"],
    })

def _include_flags(ctx, compilation_contexts):
    # "." and the bin directory: headers of packages without an include prefix
    # (tests) are included by their path from the workspace root, generated ones too;
    # refit's own (<refit/cuda/fill.h>) come from the deps' include paths.
    flags = {"-I.": None, "-I" + ctx.bin_dir.path: None}
    for cc in compilation_contexts:
        for d in cc.quote_includes.to_list() + cc.includes.to_list():
            flags["-I" + d] = None
        for d in cc.system_includes.to_list():
            flags["--system-include=" + d] = None
        for d in cc.defines.to_list():
            flags["-D" + d] = None
    return flags.keys()

def _object_path(ctx, src):
    rel = src.short_path
    if ctx.label.package and rel.startswith(ctx.label.package + "/"):
        rel = rel[len(ctx.label.package) + 1:]
    return "_nvcc/%s/%s.o" % (ctx.label.name, rel[:-len(src.extension) - 1])

def _own_headers(ctx):
    # The library's own headers at their include paths (<refit/cuda/fill.h>): the
    # cc_library that gives them that path to others is built from these objects,
    # so the .cu files see them through links of their own.
    root = "_nvcc/%s/include" % ctx.label.name
    links = []
    for h in ctx.files.hdrs:
        rel = h.short_path.split(ctx.label.package + "/", 1)[1]
        link = ctx.actions.declare_file(root + "/" + refit_include_path(ctx.label.package, ctx.label.package + "/" + rel))
        ctx.actions.symlink(output = link, target_file = h)
        links.append(link)
    include = ctx.bin_dir.path + "/" + (ctx.label.workspace_root + "/" if ctx.label.workspace_root else "") + \
              (ctx.label.package + "/" if ctx.label.package else "") + root
    return links, "-I" + include

def _nvcc_objects_impl(ctx):
    contexts = [d[CcInfo].compilation_context for d in ctx.attr.deps]
    own, own_include = _own_headers(ctx)
    headers = depset(ctx.files.hdrs + own, transitive = [cc.headers for cc in contexts])
    flags = [own_include] + list(_include_flags(ctx, contexts))

    objects = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file(_object_path(ctx, src))
        objects.append(obj)
        if not CUDA_FOUND:
            ctx.actions.run_shell(
                outputs = [obj],
                command = "echo \"ERROR: $1\" >&2; exit 1",
                arguments = [CUDA_MISSING_MESSAGE],
                mnemonic = "Nvcc",
            )
            continue
        ctx.actions.run(
            executable = NVCC,
            arguments = _NVCC_FLAGS + flags + ctx.attr.nvcc_flags +
                        ["-c", src.path, "-o", obj.path],
            inputs = depset([src], transitive = [headers]),
            outputs = [obj],
            # nvcc finds the host compiler (gcc) on PATH.
            use_default_shell_env = True,
            mnemonic = "Nvcc",
            progress_message = "Compiling CUDA %s" % src.short_path,
        )
    return [DefaultInfo(files = depset(objects))]

_nvcc_objects = rule(
    implementation = _nvcc_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"], mandatory = True),
        "hdrs": attr.label_list(allow_files = True),
        "deps": attr.label_list(providers = [CcInfo]),
        "nvcc_flags": attr.string_list(),
    },
)

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_flags = [], **kwargs):
    """A cc_library whose srcs are .cu files, compiled by nvcc for sm_90.

    Args:
      name: the cc_library; `<name>_nvcc` holds the objects.
      srcs: .cu files; they include headers relative to the workspace root.
      hdrs: public headers, also visible to the .cu files.
      deps: cc_library deps, whose headers, include paths and defines nvcc sees.
      nvcc_flags: extra nvcc flags, after the defaults.
      **kwargs: passed to the cc_library (visibility, tags, testonly, ...).
    """
    compatible = cuda_only()
    _nvcc_objects(
        name = name + "_nvcc",
        srcs = srcs,
        hdrs = hdrs,
        deps = deps,
        nvcc_flags = nvcc_flags,
        tags = kwargs.get("tags", []),
        testonly = kwargs.get("testonly", False),
        target_compatible_with = compatible,
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        srcs = [":" + name + "_nvcc"],
        hdrs = hdrs,
        deps = deps + ["@refit_local_cuda//:cudart_static"],
        target_compatible_with = compatible,
        **dict(refit_include_prefix(native.package_name()), **kwargs)
    )

def cuda_test(name, srcs, deps = [], gpu = False, size = "small", **kwargs):
    """A CUDA test: one self-contained binary (static CUDA runtime, so it can be
    copied to a GPU machine), built only with --config=cuda, linked with gtest_main.
    gpu = True tags it "gpu": it needs a device and skips itself, with the reason,
    without one."""
    native.cc_test(
        name = name,
        size = size,
        srcs = srcs,
        linkstatic = True,
        tags = (["gpu"] if gpu else []) + kwargs.pop("tags", []),
        target_compatible_with = cuda_only(),
        deps = deps + ["//third_party:gtest_main"],
        **kwargs
    )
