#!/usr/bin/env bash
# The benchmark suite and its report, in one command:
#
#   scripts/bench.sh                         full profile: docs/perf/results.json,
#                                            docs/performance.md, docs/perf/*.svg
#   scripts/bench.sh --profile smoke         seconds; figures not meaningful
#   scripts/bench.sh --scenarios store-postgres,store-redis --out /tmp/r.json --report /tmp/p.md
#
# Starts the servers of scripts/servers.sh when they are not running (and stops on exit
# only what it started), builds the release binary with every feature, then runs
# `idemq bench suite` (each scenario in its own process) holding /tmp/idemq-servers.lock,
# the lock a server restart takes on a shared machine. `idemq bench report` re-renders the
# report from a results file without measuring.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/toolchain.sh
# Servers up (stopped on exit only if this run started them), URLs exported.
source scripts/servers-up.sh
cargo build --release --all-features --bin idemq
lock=${IDEMQ_BENCH_LOCK:-/tmp/idemq-servers.lock}
if command -v flock >/dev/null; then
  flock "$lock" target/release/idemq bench suite "$@"
else
  target/release/idemq bench suite "$@"
fi
