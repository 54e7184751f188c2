#!/usr/bin/env bash
# The full test suite, with the real servers scripts/servers.sh runs (PostgreSQL, MariaDB,
# Redis and a Redis Cluster, Kafka, RabbitMQ, RocketMQ):
#
#   scripts/test.sh [extra cargo test args...]
#
# IDEMQ_KEEP_SERVERS=1 leaves the servers running afterwards (then
# `eval "$(scripts/servers.sh env)"` and run single tests by hand).
# Exits with cargo's status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/toolchain.sh

# Servers up (stopped on exit only if this run started them), URLs exported.
source scripts/servers-up.sh

status=0
cargo test --workspace --all-features "$@" || status=$?
# The protocol model's state counts, into the log (libtest hides a passing test's output).
if ((status == 0)) && (($# == 0)); then
  cargo test -q -p idemq-core --all-features --test protocol_model -- --nocapture 2>&1 |
    grep -E 'states|counterexample|test result' || status=$?
fi
exit "$status"
