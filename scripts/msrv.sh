#!/usr/bin/env bash
# The minimum supported Rust version (workspace `rust-version` in Cargo.toml) builds the whole
# workspace, every feature and target, with the locked dependencies. Installs that toolchain
# (minimal profile) when it is missing; skips the install when it is there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

msrv=$(sed -n 's/^rust-version = "\([0-9.]*\)"/\1/p' Cargo.toml | head -n 1)
[[ -n $msrv ]] || { echo "msrv: no rust-version in Cargo.toml" >&2; exit 1; }
# rustup names a toolchain by its full version.
[[ $msrv =~ ^[0-9]+\.[0-9]+$ ]] && msrv="$msrv.0"
# When the default toolchain *is* that version, the clippy and test builds of CI already
# compiled everything with it: a second build under rustup's other name for the same
# compiler would only redo the work.
default=$(rustc --version | awk '{print $2}')
if [[ $default == "$msrv" ]]; then
  echo "msrv: the default toolchain is Rust $msrv itself (rustc $default): the CI build checks it"
  exit 0
fi
if ! rustup run "$msrv" rustc --version >/dev/null 2>&1; then
  rustup toolchain install "$msrv" --profile minimal
fi
echo "msrv: cargo check with $(rustup run "$msrv" rustc --version)"
rustup run "$msrv" cargo check -q --workspace --all-features --all-targets --locked
echo "msrv: the workspace builds with Rust $msrv"
