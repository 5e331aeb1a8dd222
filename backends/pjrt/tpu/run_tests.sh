#!/usr/bin/env bash
# Installs the pinned Python packages and runs the TPU-kernel tests (Pallas TPU interpret mode
# on the CPU, tpu export, Mosaic dumps in tests/artifacts/). Exit status 0 only when tests ran
# and passed. FP8NSA_TPU_SKIP_PIP=1 skips the install (e.g. on a TPU VM with jax[tpu]).
set -euo pipefail
cd "$(dirname "$0")"

if [ "${FP8NSA_TPU_SKIP_PIP:-0}" != 1 ]; then
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
        "jax[cpu]==0.10.2" "jaxlib==0.10.2" "ml_dtypes==0.6.0" "flatbuffers==25.12.19" \
        "pytest==9.2.0"
fi

rc=0
python3 -m pytest -q -rs tests "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "run_tests.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
