#!/usr/bin/env bash
# Runs gpu_report_test.py (arg 1) against gpu_report.py (arg 2).
set -euo pipefail
exec python3 "$1" "$2"
