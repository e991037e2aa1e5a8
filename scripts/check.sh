#!/usr/bin/env bash
# The one command that checks everything, in the order cheapest-first: install, formatting, lints,
# Rust tests, Python tests (which include the mypy stubtest of the native module's stubs).
# CI (.ci/run) runs exactly this; .pre-commit-config.yaml runs the same checks before a commit.
# Each stage prints its wall time. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

stage() {
    local name=$1 t0=$SECONDS
    shift
    echo "== $name: $*"
    "$@"
    echo "== $name: $((SECONDS - t0)) s"
}

stage install "$PY" -m pip install ".[test]"
stage rustfmt cargo fmt --all --check
stage ruff "$PY" -m ruff check .
stage clippy cargo clippy --workspace --all-targets -- -D warnings
stage cargo-test cargo test --workspace --exclude rlx-py
stage pytest "$PY" -m pytest -q
