"""refit's repositories, for refit's own WORKSPACE and for every workspace that uses it.

    local_repository(name = "refit", path = "/path/to/refit")
    load("@refit//:repositories.bzl", "refit_dependencies")
    refit_dependencies()

Nothing here downloads. It defines:

  rules_cc, rules_java, remote_coverage_tools
      offline stand-ins that Bazel 4.2.3 asks for even in pure C++ builds (only
      where the workspace has not defined them itself);
  refit_local_cuda
      the CUDA toolkit and NCCL of this machine ($CUDA_HOME, else /usr/local/cuda),
      used by the GPU engines under --define=refit_cuda=1 (refit's --config=cuda);
  refit_local_python
      the Python headers and nanobind of $REFIT_PYTHON (else python3), used only by
      the extension module in //python;
  refit_local_torch
      libtorch ($REFIT_LIBTORCH, a torch wheel, or Debian's libtorch-dev), used only
      by the optional lib/torch adapter.

The system libraries refit links (asio, nlohmann-json, xxhash, OpenSSL's libcrypto;
GoogleTest for tests) are Debian 12 packages: see the README.
"""

load("//third_party/cuda:repo.bzl", "local_cuda_repository")
load("//third_party/python:repo.bzl", "local_python_repository")
load("//third_party/torch:repo.bzl", "local_torch_repository")

def _shim_impl(rctx):
    # The stand-in's files live in refit's tree (third_party/shims/<name>); the
    # repository links them, so it works wherever refit is.
    src = rctx.path(rctx.attr.marker).dirname
    for f in src.readdir():
        rctx.symlink(f, f.basename)

_shim_repository = repository_rule(
    implementation = _shim_impl,
    attrs = {"marker": attr.label(mandatory = True, allow_single_file = True)},
)

_SHIMS = {
    "rules_cc": Label("//third_party/shims/rules_cc:WORKSPACE"),
    "rules_java": Label("//third_party/shims/rules_java:WORKSPACE"),
    "remote_coverage_tools": Label("//third_party/shims/remote_coverage_tools:WORKSPACE"),
}

def refit_dependencies():
    """Defines every repository refit's targets need; call it from WORKSPACE."""
    existing = native.existing_rules()
    for name, marker in _SHIMS.items():
        if name not in existing:
            _shim_repository(name = name, marker = marker)
    if "refit_local_cuda" not in existing:
        local_cuda_repository(name = "refit_local_cuda")
    if "refit_local_torch" not in existing:
        local_torch_repository(name = "refit_local_torch")
    if "refit_local_python" not in existing:
        local_python_repository(name = "refit_local_python")
