#!/usr/bin/env bash
# Runs refit_ipc_test.py with the system's python3 (standard library only).
set -euo pipefail
exec python3 "$1" --worker-bin "$2"
