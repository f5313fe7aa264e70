"""The NIXL bench's venv works: NIXL's agent starts its UCX backend without a GPU."""
import os

from nixl_cu13._api import nixl_agent, nixl_agent_config

agent = nixl_agent("venv-check", nixl_agent_config(backends=["UCX"]))
assert "UCX" in agent.get_plugin_list(), agent.get_plugin_list()
print("nixl venv ok")
# nixl-cu13 1.5.1 crashes (SIGSEGV) tearing its agent down at interpreter exit,
# after everything worked; leave without the teardown.
os._exit(0)
