#!/usr/bin/env bash
# run_vllm_own_tests.sh VENV [PYTEST_ARGS...]
#
# Smoke check of a venv made by python/venv.sh: runs vLLM 0.33.0's own CPU-runnable
# weight-transfer tests (from vLLM's sdist) against the vLLM installed in VENV:
#   tests/distributed/test_weight_transfer.py        info parsing and validation, both
#       factories and their registries, the trainer clients (HTTP bodies, Ray
#       requests), ModuleSource/ParamMeta, the deferred-processing contract, the
#       NCCL/IPC/sparse trainers' start -> update -> finish order on a recording client
#   tests/distributed/test_weight_transfer_nccl_uid.py   NCCL unique-id init info
#   tests/distributed/test_weight_transfer_m2n.py    nccl_m2n wire types, layouts, plans
#   tests/distributed/test_sharded_rdt_plan.py       layerwise groups, RDT plans
#   tests/distributed/test_packed_tensor.py          packed-tensor helpers
#   tests/v1/worker/test_gpu_worker_weight_transfer.py  GPUWorker's update session
#       guard and its delegation to the engine
# Tests that need a GPU skip themselves (their own skipif markers) or are
# deselected below, each with its reason.
#
# The sdist is fetched once through pip's own index machinery (pip.conf honoured)
# into ${REFIT_CACHE:-$HOME/.cache/refit} and checked against its sha256; set
# VLLM_SDIST=/path/to/vllm-0.33.0.tar.gz to use a copy you already have.
#
# The test files are copied into a scratch directory whose conftest holds only the
# two fixtures they use (caplog_vllm and its helper, copied from vLLM), so
# vLLM's repository-wide tests/conftest.py (which imports LLM, transformers models,
# tblib, ...) is not loaded. Where `ray` is not installed in VENV (python/venv.sh
# does not install it: nothing refit needs imports it), a stub `ray` is put on
# PYTHONPATH for this run only: test_weight_transfer.py imports ray at module
# level and decorates its GPU actors with @ray.remote; every test that really uses
# Ray needs a GPU and is skipped or deselected below, and the one CPU test that
# touches ray (test_ray_client_sends_typed_requests) monkeypatches ray.get.
#
# Exit status: pytest's. Prints pytest's summary; the last line is the summary line.
set -euo pipefail

die() { echo "run_vllm_own_tests.sh: error: $*" >&2; exit 1; }

[ $# -ge 1 ] || die "usage: $0 VENV [PYTEST_ARGS...]"
VENV=$1; shift
PY="$VENV/bin/python"
[ -x "$PY" ] || die "$PY not found: make the venv first with python/venv.sh"

VLLM_VERSION=0.33.0
SDIST_SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
CACHE=${REFIT_CACHE:-$HOME/.cache/refit}
SDIST=${VLLM_SDIST:-$CACHE/vllm-$VLLM_VERSION.tar.gz}

installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null) ||
  die "vllm is not installed in $VENV"
[ "$installed" = "$VLLM_VERSION" ] || die "$VENV has vllm $installed; these are vLLM $VLLM_VERSION's tests"
"$PY" -c 'import pytest' 2>/dev/null || die "pytest is not installed in $VENV"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SDIST_SHA256" ]; }

if ! sha_ok "$SDIST"; then
  [ -n "${VLLM_SDIST:-}" ] && die "VLLM_SDIST=$VLLM_SDIST is missing or is not vllm-$VLLM_VERSION.tar.gz (sha256 $SDIST_SHA256)"
  mkdir -p "$CACHE"
  echo "fetching vllm-$VLLM_VERSION.tar.gz (vLLM's sdist, for its tests) through pip's index ..." >&2
  # `pip download --no-binary :all: vllm` would build the sdist's metadata (it
  # cannot, without CUDA and vLLM's build deps), so ask pip's finder for the link
  # and download it with pip's session: same index, certificates and proxy as pip.
  "$PY" - "$SDIST.part" "$VLLM_VERSION" <<'EOF' || die "could not download vLLM's sdist through pip (see above)"
import sys
from pip._internal.commands import create_command
out, version = sys.argv[1], sys.argv[2]
cmd = create_command("download")
opts, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", f"vllm=={version}"])
session = cmd._build_session(opts)
finder = cmd._build_package_finder(options=opts, session=session)
links = [c.link for c in finder.find_all_candidates("vllm")
         if str(c.version) == version and c.link.filename == f"vllm-{version}.tar.gz"]
if not links:
    sys.exit(f"no vllm-{version}.tar.gz on the index")
r = session.get(links[0].url_without_fragment, stream=True)
r.raise_for_status()
with open(out, "wb") as f:
    for chunk in r.iter_content(1 << 20):
        f.write(chunk)
EOF
  mv "$SDIST.part" "$SDIST"
  sha_ok "$SDIST" || die "$SDIST does not have the expected sha256 $SDIST_SHA256"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vllm-own-tests.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

FILES=(
  tests/__init__.py
  tests/distributed/__init__.py
  tests/distributed/test_weight_transfer.py
  tests/distributed/test_weight_transfer_nccl_uid.py
  tests/distributed/test_weight_transfer_m2n.py
  tests/distributed/test_sharded_rdt_plan.py
  tests/distributed/test_packed_tensor.py
  tests/v1/__init__.py
  tests/v1/worker/__init__.py
  tests/v1/worker/test_gpu_worker_weight_transfer.py
)
tar -xzf "$SDIST" -C "$WORK" --strip-components=1 "${FILES[@]/#/vllm-$VLLM_VERSION/}" ||
  die "$SDIST lacks some of: ${FILES[*]}"

# vLLM's markers (pyproject.toml), no repository conftest.
cat >"$WORK/pytest.ini" <<'EOF'
[pytest]
markers =
    slow_test
    skip_global_cleanup
    core_model
    hybrid_model
    cpu_model
    cpu_test
    split
    distributed
    optional
EOF
# The two fixtures of vLLM's tests/conftest.py these files use, verbatim.
cat >"$WORK/conftest.py" <<'EOF'
import pytest


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch):
    import logging

    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        yield caplog
EOF

if ! "$PY" -c 'import ray' 2>/dev/null; then
  mkdir -p "$WORK/_stubs/ray/util"
  cat >"$WORK/_stubs/ray/__init__.py" <<'EOF'
"""Stand-in for `ray` (not installed): lets vLLM's test modules import and define
their @ray.remote GPU actors. Anything that would really use Ray raises."""


class RayStubError(RuntimeError):
    pass


def _unavailable(*_args, **_kwargs):
    raise RayStubError("ray is not installed; this test needs a real Ray (and a GPU)")


def remote(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda obj: obj


def is_initialized():
    return False


init = get = get_gpu_ids = get_actor = put = wait = kill = _unavailable
EOF
  cat >"$WORK/_stubs/ray/util/__init__.py" <<'EOF'
EOF
  cat >"$WORK/_stubs/ray/util/placement_group.py" <<'EOF'
from ray import _unavailable as placement_group  # noqa: F401
EOF
  cat >"$WORK/_stubs/ray/util/scheduling_strategies.py" <<'EOF'
from ray import _unavailable as PlacementGroupSchedulingStrategy  # noqa: F401
EOF
  cat >"$WORK/_stubs/ray/actor.py" <<'EOF'
ActorHandle = object
EOF
  export PYTHONPATH="$WORK/_stubs${PYTHONPATH:+:$PYTHONPATH}"
  echo "note: ray is not installed in $VENV; using a stub ray for this run" >&2
fi

HAVE_GPU=$("$PY" -c 'import torch; print(1 if torch.accelerator.device_count() > 0 else 0)' 2>/dev/null || echo 0)

# Tests that need a GPU (CUDA tensors, NCCL, CUDA IPC) but carry no skip marker of
# their own; each is deselected with its reason. (Tests with a skipif on the
# device count are left to skip themselves.)
DESELECT=(
  # nccl_m2n init failure paths: the engine and trainer allocate on the current
  # CUDA device (torch.accelerator.current_device_index()) before the injected
  # failure the tests expect, so without an NVIDIA driver they fail with "Found
  # no NVIDIA driver" instead of the error under test.
  "tests/distributed/test_weight_transfer_m2n.py::TestWireTypes::test_worker_rejects_active_reinit_but_allows_init_after_shutdown"
  "tests/distributed/test_weight_transfer_m2n.py::TestWireTypes::test_partial_worker_initialization_releases_transport_resources"
  "tests/distributed/test_weight_transfer_m2n.py::TestTrainerSourceContract::test_partial_trainer_initialization_releases_transport_resources"
)
if [ "$HAVE_GPU" = 1 ]; then DESELECT=(); fi   # a GPU: run them all

export VLLM_PLUGINS=${VLLM_PLUGINS-}     # load no general plugins (vLLM's LoRA resolvers) during the run
# vLLM's CUDA wheel finds no platform on a machine without a GPU, and VllmConfig()
# (the GPUWorker tests) then fails "Failed to infer device type"; vLLM's own
# CPU-only CI selects the CPU platform the same way.
if [ "$HAVE_GPU" = 0 ]; then export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu}; fi
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

args=(-q -rs -p no:cacheprovider --rootdir "$WORK" -c "$WORK/pytest.ini")
for d in "${DESELECT[@]}"; do args+=(--deselect "$d"); done

cd "$WORK"
set +e
"$PY" -m pytest "${args[@]}" "$@" \
  tests/distributed/test_weight_transfer.py \
  tests/distributed/test_weight_transfer_nccl_uid.py \
  tests/distributed/test_weight_transfer_m2n.py \
  tests/distributed/test_sharded_rdt_plan.py \
  tests/distributed/test_packed_tensor.py \
  tests/v1/worker/test_gpu_worker_weight_transfer.py
rc=$?
set -e
exit $rc
