#!/usr/bin/env bash
# The fault-injection soak (tests/chaos.rs) against the servers of scripts/servers.sh:
# broker × store pairs, consumer processes SIGKILLed, self-aborted and SIGSTOPped past
# their lease, PostgreSQL crashed mid-run; exits non-zero on any double effect or loss.
#
#   scripts/chaos.sh                      every pair, CI profile (3000 keys, 3 kills)
#   scripts/chaos.sh kafka_postgres       one pair (test name suffix)
#   IDEMQ_CHAOS_MESSAGES=1000000 IDEMQ_CHAOS_KILLS=10 IDEMQ_CHAOS_LIMIT_SECS=7200 \
#     scripts/chaos.sh                    the long profile
#
# Each pair prints one line: keys, published, faults, rows, double_effects, lost.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/toolchain.sh
bash scripts/servers.sh start
eval "$(bash scripts/servers.sh env)"
filter=()
if (($#)); then filter=("chaos_$1"); fi
cargo test --release --all-features --test chaos -- --nocapture --test-threads=1 "${filter[@]}" 2>&1 |
  grep -E '^chaos |SIG|crashed|panicked|^test |test result'
exit "${PIPESTATUS[0]}"
