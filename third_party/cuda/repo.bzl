"""Placeholder until the CUDA repository rule lands."""
def _impl(ctx):
    ctx.file("BUILD", "")
local_cuda_repository = repository_rule(implementation = _impl)
