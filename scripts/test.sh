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

# Stop on exit only what this run started: servers that were already up
# belong to someone (a developer's session, a parallel run) still using them.
if [[ ${IDEMQ_KEEP_SERVERS:-0} != 1 ]] && ! bash scripts/servers.sh status >/dev/null 2>&1; then
  trap 'bash scripts/servers.sh stop || true' EXIT
fi
bash scripts/servers.sh start
eval "$(bash scripts/servers.sh env)"

status=0
cargo test --workspace --all-features "$@" || status=$?
exit "$status"
