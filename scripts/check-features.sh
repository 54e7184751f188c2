#!/usr/bin/env bash
# Each feature of the `idemq` facade builds alone, as a library user would take it
# (default features off, that one feature on), and the CLI builds with only its own:
#
#   scripts/check-features.sh              every feature
#   scripts/check-features.sh redis kafka  just these
#
# `cargo check` only (no tests); warnings are errors. kafka builds librdkafka's C sources
# and rocketmq the largest dependency tree here: several minutes each on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

features=("$@")
if ((${#features[@]} == 0)); then
  features=(sqlite postgres mysql redis layered rabbitmq rabbitmq-streams kafka rocketmq testkit cli)
fi
export RUSTFLAGS="${RUSTFLAGS:-} -D warnings"
for f in "${features[@]}"; do
  echo "check-features: idemq --no-default-features --features $f"
  if [[ $f == cli ]]; then
    cargo check -q -p idemq --no-default-features --features cli --bins
  else
    cargo check -q -p idemq --lib --no-default-features --features "$f"
  fi
done
echo "check-features: ${#features[@]} feature(s) build alone"
