#!/usr/bin/env bash
# Make sure the Rust toolchain has rustfmt and clippy: .ci/run's fmt and
# clippy steps need them, and a minimal rustup profile lacks them.
set -euo pipefail

if ! command -v cargo >/dev/null; then
  echo "toolchain: cargo not found; install Rust (https://rustup.rs) first" >&2
  exit 1
fi
# A distro cargo has no rustup: nothing we can add, let the caller fail later.
command -v rustup >/dev/null || exit 0

installed=$(rustup component list --installed 2>/dev/null || true)
for component in rustfmt clippy; do
  if ! grep -q "^$component" <<<"$installed"; then
    # Not fatal: `cargo test` works without them; fmt/clippy will say so clearly.
    rustup component add "$component" ||
      echo "toolchain: WARNING: could not add $component" >&2
  fi
done
