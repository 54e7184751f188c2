#!/usr/bin/env bash
# The checks that build nothing the tests run: clippy with warnings as errors, rustdoc without
# a warning, each facade feature alone, packaging, the minimum Rust version.
#
#   scripts/static-checks.sh
#
# .ci/run runs it beside the tests, at the lowest priority, in a target dir of its own.
set -euxo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo clippy --workspace --all-targets --all-features -- -D warnings
# Rustdoc of every public item, intra-doc links included, without a warning.
RUSTDOCFLAGS="-D warnings" cargo doc -q --workspace --no-deps --all-features
# Each facade feature alone, as a library user takes it.
bash scripts/check-features.sh
# Publishing readiness: every crate packages with real metadata.
bash scripts/package-check.sh
# The stated minimum Rust version builds everything.
bash scripts/msrv.sh
