#!/usr/bin/env bash
# Each feature of the `idemq` facade builds alone, as a library user would take it
# (default features off, that one feature on), and the CLI (idemq-cli) builds with its defaults:
#
#   scripts/check-features.sh              every feature
#   scripts/check-features.sh redis kafka  just these
#
# `cargo clippy` only (no tests), warnings as errors for idemq's own crates. Not through
# RUSTFLAGS: that would rebuild every dependency for every feature. A feature whose
# dependencies need other feature flags (tokio, sqlx) still rebuilds those.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

features=("$@")
if ((${#features[@]} == 0)); then
  features=(sqlite postgres mysql redis nats-kv layered rabbitmq rabbitmq-streams kafka rocketmq nats testkit cli)
fi
for f in "${features[@]}"; do
  echo "check-features: idemq --no-default-features --features $f"
  if [[ $f == cli ]]; then
    # The command line (crate idemq-cli) with its default features alone.
    cargo clippy -q -p idemq-cli --bins -- -D warnings
  else
    cargo clippy -q -p idemq --lib --no-default-features --features "$f" -- -D warnings
  fi
done
echo "check-features: ${#features[@]} feature(s) build alone"
