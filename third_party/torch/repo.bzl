"""Placeholder until the torch repository rule lands."""
def _impl(ctx):
    ctx.file("BUILD", "")
local_torch_repository = repository_rule(implementation = _impl)
