#!/usr/bin/env bash
# The fault-injection soak (tests/chaos.rs) against the servers of scripts/servers.sh:
# broker (Kafka flows 1-3, RabbitMQ queues and streams, RocketMQ, NATS JetStream) × store pairs, consumer
# processes SIGKILLed, self-aborted and SIGSTOPped past their lease, the store's server
# crashed and the broker restarted mid-run, the consumers' store (and, where the client dials
# only the address it is given, broker) links faulted through Toxiproxy: replies cut, held
# past the lease, a half-open link, a partition (IDEMQ_CHAOS_NETWORK=never: not); exits
# non-zero on any double effect or loss.
#
#   scripts/chaos.sh                      every pair, CI profile (3000 keys, 3 kills)
#   scripts/chaos.sh kafka_db_postgres    the pairs whose test name contains chaos_<this>
#   IDEMQ_CHAOS_MESSAGES=1000000 IDEMQ_CHAOS_KILLS=10 IDEMQ_CHAOS_BROKER_RESTART=all \
#     IDEMQ_CHAOS_LIMIT_SECS=7200 scripts/chaos.sh    the long profile
#
# It restarts shared servers: on a machine where others run benchmarks, take their lock
# around it (flock /tmp/idemq-servers.lock scripts/chaos.sh ...).
#
# Each pair prints one line: keys, published, faults (network faults and the links they hit
# among them), the ambiguous outcomes the consumers met (in_net: while a network fault was
# on), rows, double_effects, lost.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/toolchain.sh
bash scripts/servers.sh start
eval "$(bash scripts/servers.sh env)"
filter=()
if (($#)); then filter=("chaos_$1"); fi
cargo test --release --all-features --test chaos -- --nocapture --test-threads=1 "${filter[@]}" 2>&1 |
  grep -E '^chaos |SIG|crashed|restarted| on slot | met: |panicked|^test |test result'
exit "${PIPESTATUS[0]}"
