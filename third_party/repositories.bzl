"""Local repositories for refit: nothing here downloads."""

load("//third_party/cuda:repo.bzl", "local_cuda_repository")
load("//third_party/torch:repo.bzl", "local_torch_repository")

def refit_system_repositories():
    # CUDA toolkit and NCCL from /usr/local/cuda (or $CUDA_HOME). When absent, the
    # repository still exists and says so; only --config=cuda targets need it.
    local_cuda_repository(name = "local_cuda")

    # libtorch: $REFIT_LIBTORCH, else the torch wheel's bundled libtorch, else
    # Debian's libtorch-dev. Only the optional lib/torch adapter needs it.
    local_torch_repository(name = "local_torch")
