# Sourced (not run) by scripts that need the servers (test.sh, bench.sh), from the repo root:
# starts what is not running and exports their URLs into the caller's shell. On exit it stops
# only what this run started: servers that were already up belong to someone (a developer's
# session, a parallel run) still using them. IDEMQ_KEEP_SERVERS=1 leaves them running.
if [[ ${IDEMQ_KEEP_SERVERS:-0} != 1 ]]; then
  # The servers down now are the ones this run starts, and the only ones it stops.
  idemq_started=$(bash scripts/servers.sh status 2>/dev/null | awk '$2 == "stopped" { print $1 }' | tr '\n' ' ')
  if [[ -n ${idemq_started// /} ]]; then
    # shellcheck disable=SC2064 # the list is fixed now, not at exit
    trap "bash scripts/servers.sh stop $idemq_started || true" EXIT
  fi
fi
bash scripts/servers.sh start
eval "$(bash scripts/servers.sh env)"
