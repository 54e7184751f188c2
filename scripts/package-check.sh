#!/usr/bin/env bash
# Every crate of the workspace packages as it would be published: real metadata (description,
# license, documentation, readme, keywords, categories, rust-version), every file it needs
# inside the package, path dependencies with versions. `--no-verify`: the tarballs are not
# rebuilt (the rest of CI builds and tests the same sources); any cargo warning fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo package --workspace --no-verify --locked --allow-dirty 2>&1 | tee "$log" | grep -v '^ *\(Packaging\|Packaged\|Updating\|Archiving\|Locking\|Adding\|Uploading\)' || true
if grep -q '^warning\|^error' "$log"; then
  echo "package-check: cargo package warned or failed (above)" >&2
  exit 1
fi
echo "package-check: $(grep -c '^ *Packaged' "$log") crate(s) package cleanly"
