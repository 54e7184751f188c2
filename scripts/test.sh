#!/usr/bin/env bash
# The test suite, against the real servers scripts/servers.sh runs (PostgreSQL, MariaDB,
# Redis and a Redis Cluster, Kafka, RabbitMQ, RocketMQ, NATS, Toxiproxy):
#
#   scripts/test.sh [--servers LIST] [extra cargo test args...]
#
#   (no option)                every server: the full suite, what CI runs
#   --servers postgres,kafka   start only these (or IDEMQ_TEST_SERVERS=postgres,kafka); a test
#                              that needs another server is skipped, and the summary counts
#                              and names it as skipped for a missing server, never as passed
#
# When the RocketMQ servers are not built yet (a machine's first run), their build starts
# first, in the background; every test that does not need RocketMQ runs meanwhile, and those
# that do run once it is up. The run ends with one line per crate and the totals; the logs
# stay in target/test-run/. IDEMQ_KEEP_SERVERS=1 leaves the servers running afterwards (then
# `eval "$(scripts/servers.sh env)"` and run single tests by hand). Exits non-zero when a
# test failed, a server could not be started, or the RocketMQ build failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ALL_SERVERS=(postgres mariadb redis redis-cluster kafka rabbitmq rocketmq nats nats-cluster toxiproxy)
# What each server gives the tests (scripts/servers.sh env): unset when it is not started.
declare -A SERVER_VARS=(
  [postgres]="IDEMQ_TEST_POSTGRES_URL IDEMQ_TEST_POSTGRES_RESTART_CMD"
  [mariadb]="IDEMQ_TEST_MYSQL_URL IDEMQ_TEST_MYSQL_RESTART_CMD"
  [redis]="IDEMQ_TEST_REDIS_URL IDEMQ_TEST_REDIS_RESTART_CMD"
  [redis-cluster]="IDEMQ_REDIS_CLUSTER_URL IDEMQ_TEST_REDIS_CLUSTER_DIR IDEMQ_TEST_REDIS_CLUSTER_RESTART_NODE_CMD"
  [kafka]="IDEMQ_TEST_KAFKA_BROKERS IDEMQ_TEST_KAFKA_RESTART_CMD IDEMQ_KAFKA_LIBS"
  [rabbitmq]="IDEMQ_TEST_AMQP_URL IDEMQ_TEST_RABBITMQ_STREAM_URL IDEMQ_TEST_RABBITMQ_RESTART_CMD"
  [rocketmq]="IDEMQ_TEST_ROCKETMQ_NAMESRV IDEMQ_TEST_ROCKETMQ_RESTART_CMD"
  [nats]="IDEMQ_TEST_NATS_URL IDEMQ_TEST_NATS_RESTART_CMD"
  [nats-cluster]="IDEMQ_TEST_NATS_CLUSTER_URL IDEMQ_TEST_NATS_CLUSTER_KILL_NODE_CMD IDEMQ_TEST_NATS_CLUSTER_RESTART_NODE_CMD"
  [toxiproxy]="IDEMQ_TEST_TOXIPROXY_URL IDEMQ_TEST_TOXIPROXY_PORTS"
)

log() { printf 'test.sh: %s\n' "$*" >&2; }
die() { printf 'test.sh: ERROR: %s\n' "$*" >&2; exit 2; }

servers_arg=${IDEMQ_TEST_SERVERS:-}
cargo_args=()
while (($#)); do
  case $1 in
    --servers) (($# >= 2)) || die "--servers needs a list, e.g. --servers postgres,kafka"
      servers_arg=$2; shift 2 ;;
    --servers=*) servers_arg=${1#--servers=}; shift ;;
    --) cargo_args+=("$@"); break ;;
    *) cargo_args+=("$1"); shift ;;
  esac
done

selected=()
if [[ -z $servers_arg || $servers_arg == all ]]; then
  selected=("${ALL_SERVERS[@]}")
else
  IFS=', ' read -r -a wanted <<<"$servers_arg"
  for w in "${wanted[@]}"; do
    [[ $w == mysql ]] && w=mariadb
    [[ -n ${SERVER_VARS[$w]+x} ]] || die "unknown server '$w' (known: ${ALL_SERVERS[*]})"
    [[ " ${selected[*]} " == *" $w "* ]] || selected+=("$w")
  done
fi
is_selected() { [[ " ${selected[*]} " == *" $1 "* ]]; }
not_started=()
for s in "${ALL_SERVERS[@]}"; do is_selected "$s" || not_started+=("$s"); done

bash scripts/toolchain.sh

run_dir=target/test-run
rm -rf "$run_dir"
mkdir -p "$run_dir"
started=$SECONDS

# Servers up; stopped on exit only if this run started them (servers already up belong to
# someone else: a developer's session, a parallel run). The RocketMQ build goes first and in
# the background, so it overlaps the test build and the tests that do not need it.
running() { bash scripts/servers.sh status 2>/dev/null | grep -q "^$1 *running"; }
ours=()
for s in "${selected[@]}"; do running "$s" || ours+=("$s"); done
build_pid=
cleanup() {
  [[ -n $build_pid ]] && kill "$build_pid" 2>/dev/null
  if [[ ${IDEMQ_KEEP_SERVERS:-0} != 1 ]] && ((${#ours[@]})); then
    bash scripts/servers.sh stop "${ours[@]}" || true
  fi
}
trap cleanup EXIT

deferred=()
if is_selected rocketmq && ! bash scripts/servers.sh rocketmq-built; then
  log "the RocketMQ servers are not built on this machine: building them in the background (progress below); tests that need RocketMQ run once they are up"
  nice -n 5 bash scripts/servers.sh build-rocketmq &
  build_pid=$!
  deferred=(rocketmq)
fi
now=()
for s in "${selected[@]}"; do [[ " ${deferred[*]} " == *" $s "* ]] || now+=("$s"); done
((${#now[@]} == 0)) || bash scripts/servers.sh start "${now[@]}"

# The env of the servers this phase has; the others are named, so their tests record a skip.
server_env() { # $1 = comma list of servers to skip
  eval "$(bash scripts/servers.sh env)"
  local s v
  for s in ${1//,/ }; do
    for v in ${SERVER_VARS[$s]}; do unset "$v"; done
  done
  export IDEMQ_SKIP_SERVERS=$1
}
join() { local IFS=,; echo "$*"; }

[[ " ${cargo_args[*]} " == *" --no-fail-fast "* ]] || cargo_args=(--no-fail-fast "${cargo_args[@]}")
status=0

# Which binary belongs to which crate (for the summary), and the build, in one step.
cargo test --workspace --all-features --no-run --message-format=json "${cargo_args[@]}" \
  >"$run_dir/artifacts.json" || status=$?
if ((status == 0)); then
  server_env "$(join "${not_started[@]}" "${deferred[@]}")"
  export IDEMQ_SKIP_LOG=$PWD/$run_dir/skipped-1.tsv
  log "running the tests${deferred:+ that do not need ${deferred[*]}} ($(join "${now[@]}") up)"
  cargo test --workspace --all-features "${cargo_args[@]}" 2>&1 | tee "$run_dir/phase-1.log" || status=$?
fi

# The tests that waited for RocketMQ: the very tests that recorded the skip, binary by binary.
if ((${#deferred[@]})); then
  log "waiting for the RocketMQ servers' build to finish"
  if ! wait "$build_pid"; then
    build_pid=
    log "the RocketMQ build failed: its tests did not run"
    status=1
  else
    build_pid=
    bash scripts/servers.sh start rocketmq || status=1
    server_env "$(join "${not_started[@]}")"
    export IDEMQ_SKIP_LOG=$PWD/$run_dir/skipped-2.tsv
    touch "$run_dir/skipped-1.tsv"
    while IFS=$'\t' read -r exe dir; do
      mapfile -t names < <(awk -F'\t' -v e="$exe" '$1 == "rocketmq" && $2 == e && $4 != "" { print $4 }' \
        "$run_dir/skipped-1.tsv" | sort -u)
      printf '     Running %s (rocketmq tests, after its build)\n' "$exe" | tee -a "$run_dir/phase-2.log"
      (cd "$dir" && CARGO_MANIFEST_DIR=$dir "$exe" ${names[@]:+--exact "${names[@]}"}) 2>&1 |
        tee -a "$run_dir/phase-2.log" || status=1
    done < <(awk -F'\t' '$1 == "rocketmq" { print $2 "\t" $3 }' "$run_dir/skipped-1.tsv" | sort -u)
  fi
fi

# The protocol model's state counts, into the log (libtest hides a passing test's output).
if ((status == 0)) && ((${#cargo_args[@]} == 1)); then
  cargo test -q --workspace --all-features --test protocol_model -- --nocapture 2>&1 |
    grep -E 'states|counterexample|test result' || status=$?
fi

bash scripts/test-summary.sh "$run_dir" "$((SECONDS - started))" || true
exit "$status"
