# Sourced (not run) by scripts that need the servers (test.sh, bench.sh), from the repo root:
# starts what is not running and exports their URLs into the caller's shell. On exit it stops
# only what this run started: servers that were already up belong to someone (a developer's
# session, a parallel run) still using them. IDEMQ_KEEP_SERVERS=1 leaves them running.
if [[ ${IDEMQ_KEEP_SERVERS:-0} != 1 ]] && ! bash scripts/servers.sh status >/dev/null 2>&1; then
  trap 'bash scripts/servers.sh stop || true' EXIT
fi
bash scripts/servers.sh start
eval "$(bash scripts/servers.sh env)"
