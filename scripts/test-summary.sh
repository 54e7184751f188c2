#!/usr/bin/env bash
# The closing summary of scripts/test.sh, from the logs it leaves in its run dir:
#
#   scripts/test-summary.sh target/test-run [seconds]
#
# One line per crate (its test binaries, doc-tests included) and the totals. A test skipped
# for a missing server (a line in skipped-*.tsv, written by idemq_core::testkit::servers)
# returned early and libtest counted it as passed: here it is taken out of "passed" and
# counted, and named, as skipped. A RocketMQ test run again after its build (phase 2) counts
# once, with the result of that run.
set -euo pipefail
dir=${1:?usage: test-summary.sh RUN_DIR [SECONDS]}
secs=${2:-}

touch "$dir/artifacts.json" "$dir/phase-1.log" "$dir/phase-2.log" "$dir/skipped-1.tsv" "$dir/skipped-2.tsv"

# binary file name <TAB> crate, from cargo's JSON artifact messages.
sed -n 's/.*"package_id":"\([^"]*\)".*"executable":"\([^"]*\)".*/\1\t\2/p' "$dir/artifacts.json" |
  awk -F'\t' '{
      id = $1
      if (index(id, "#")) {
        url = id; sub(/#.*/, "", url); sub(/.*#/, "", id)
        # "…/core#idemq-core@0.1.0", or "…/idemq#0.1.0" when the dir is named as the crate
        if (index(id, "@")) sub(/@.*/, "", id); else { k = split(url, u, "/"); id = u[k] }
      } else { sub(/ .*/, "", id) }
      n = split($2, p, "/"); print p[n] "\t" id
    }' >"$dir/binaries.tsv"

awk -F'\t' -v secs="$secs" '
  # binaries.tsv: which crate a test binary belongs to
  FILENAME ~ /binaries.tsv$/ { crate[$1] = $2; next }
  # skipped-N.tsv: server, binary path, package dir, test name
  FILENAME ~ /skipped-[12].tsv$/ {
    phase = (FILENAME ~ /skipped-1/) ? 1 : 2
    n = split($2, p, "/"); bin = p[n]
    k = phase SUBSEP bin SUBSEP $4
    if (k in seen) next
    seen[k] = 1
    skipped[phase, bin]++
    if (phase == 1 && $1 == "rocketmq") rerun[bin]++
    why[phase, bin, $4] = $1
    next
  }
  # phase-N.log: libtest output
  /^ *Running / {
    phase = (FILENAME ~ /phase-1/) ? 1 : 2
    line = $0
    if (match(line, /\([^()]*\/deps\/[^)]*\)/)) { path = substr(line, RSTART + 1, RLENGTH - 2) }
    else { sub(/^ *Running /, "", line); sub(/ .*/, "", line); path = line }
    n = split(path, p, "/"); cur = p[n]
    if (phase == 2) deferred_run = 1
    next
  }
  /^ *Doc-tests / { split($0, w, " "); c = w[2]; gsub(/_/, "-", c); cur = "doc:" c; crate[cur] = c; next }
  /^test .* \.\.\. FAILED$/ { t = $0; sub(/^test /, "", t); sub(/ \.\.\. FAILED$/, "", t); failed_names[++nf] = crate_of(cur) ": " t; next }
  /^test result: / {
    phase = (FILENAME ~ /phase-1/) ? 1 : 2
    pa = fa = ig = 0
    if (match($0, /[0-9]+ passed/)) pa = substr($0, RSTART, RLENGTH) + 0
    if (match($0, /[0-9]+ failed/)) fa = substr($0, RSTART, RLENGTH) + 0
    if (match($0, /[0-9]+ ignored/)) ig = substr($0, RSTART, RLENGTH) + 0
    passed[phase, cur] += pa; failed[cur] += fa; ignored[cur] += ig
    bins[cur] = 1
    # What the binary cost: the wall time libtest gives for it ("finished in 12.34s").
    if (match($0, /finished in [0-9.]+s/)) took[cur] += substr($0, RSTART + 12, RLENGTH - 13) + 0
    next
  }
  function crate_of(b,   c) {
    if (b in crate) return crate[b]
    c = b; sub(/-[0-9a-f]+$/, "", c); return c
  }
  END {
    for (b in bins) {
      c = crate_of(b)
      p1 = passed[1, b] - skipped[1, b]
      p2 = passed[2, b] - skipped[2, b]
      # A test skipped in phase 1 for RocketMQ and run in phase 2 is not a skip any more.
      s = skipped[1, b] - (deferred_run ? rerun[b] : 0) + skipped[2, b]
      cp[c] += p1 + p2; cf[c] += failed[b]; ci[c] += ig_or0(ignored[b]); cs[c] += s; cb[c]++
      tp += p1 + p2; tf += failed[b]; ti += ig_or0(ignored[b]); ts += s; tb++
    }
    print ""
    print "---- test summary ----"
    nc = 0
    for (c in cb) names[++nc] = c
    # insertion sort: awk has no portable sort
    for (i = 2; i <= nc; i++) { v = names[i]; j = i - 1; while (j > 0 && names[j] > v) { names[j + 1] = names[j]; j-- } names[j + 1] = v }
    for (i = 1; i <= nc; i++) {
      c = names[i]
      printf "%-16s %3d binaries  %5d passed  %3d failed  %3d ignored  %3d skipped for a missing server\n", c, cb[c], cp[c], cf[c], ci[c], cs[c]
    }
    printf "%-16s %3d binaries  %5d passed  %3d failed  %3d ignored  %3d skipped for a missing server%s\n", "TOTAL", tb, tp, tf, ti, ts, (secs != "" ? sprintf("  (%d s)", secs) : "")
    for (i = 1; i <= nf; i++) print "FAILED: " failed_names[i]
    shown = 0
    for (k in why) {
      split(k, kk, SUBSEP)
      # Skipped in phase 1 for RocketMQ and run in phase 2: not a skip.
      if (kk[1] == 1 && why[k] == "rocketmq" && deferred_run) continue
      if (shown++ < 40) printf "skipped (needs %s): %s %s\n", why[k], crate_of(kk[2]), (kk[3] == "" ? "(whole binary)" : kk[3])
    }
    if (shown > 40) printf "skipped: ... and %d more (%s)\n", shown - 40, "target/test-run/skipped-*.tsv"
    # The cost of each test group, so that a new test or server can be weighed against the
    # CI budget: the slowest binaries by the wall time libtest gives (each binary runs alone; its
    # tests run in parallel inside it), and the share of the run they are.
    nt = 0; tt = 0
    for (b in took) { slow[++nt] = b; tt += took[b] }
    for (i = 2; i <= nt; i++) { v = slow[i]; j = i - 1; while (j > 0 && took[slow[j]] < took[v]) { slow[j + 1] = slow[j]; j-- } slow[j + 1] = v }
    if (nt > 0) {
      print "---- test cost: the 15 slowest binaries (libtest wall time) ----"
      for (i = 1; i <= nt && i <= 15; i++) {
        b = slow[i]; c = crate_of(b); n = b; sub(/-[0-9a-f]+$/, "", n)
        printf "%8.1f s  %5.1f %%  %-16s %s\n", took[b], (tt > 0 ? 100 * took[b] / tt : 0), c, n
      }
      printf "%8.1f s  in %d binaries\n", tt, nt
    }
  }
  function ig_or0(x) { return x + 0 }
' "$dir/binaries.tsv" "$dir/skipped-1.tsv" "$dir/skipped-2.tsv" "$dir/phase-1.log" "$dir/phase-2.log"
