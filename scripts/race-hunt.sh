#!/usr/bin/env bash
# Hunt the suite's races: the README's test command, ROUNDS times, with every core kept busy
# by a CPU burner beside it (a test that passes alone but fails on a loaded machine asserts
# before the event it waits for). At the end: which tests failed in which round.
#
#   scripts/race-hunt.sh [-n ROUNDS] [--no-docker] [--burners N] [-- EXTRA CARGO TEST ARGS]
#
#   -n ROUNDS     rounds of the whole suite (default 5)
#   --no-docker   run as a newcomer without Docker does: DOCKER_HOST and the swarm variables
#                 (CCCI_SWARM_MANAGER, CCCI_SWARM_WORKER) unset, so the Docker tests skip
#   --burners N   CPU burners beside the suite (default: one per core, `nproc`)
#   -- ARGS       passed to `cargo test` after the README's own arguments (a filter, say:
#                 `-- --test integration -- drone::`)
#
# Each round's output is kept in $RACE_HUNT_DIR (default: a new directory under /tmp, named at
# the start). The test binaries are built once before the first round, with nothing burning;
# set CARGO_TARGET_DIR to hunt from a copy of target/ while you build in this one (cargo locks
# its target directory for as long as a `cargo test` runs). Exit status: 0 when every round
# passed, 1 otherwise. Each round's line gives its wall time and, with /usr/bin/time (Debian's
# `time` package), its CPU time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

rounds=5
burners=$(nproc)
docker=yes
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n) rounds=${2:?-n needs a number}; shift 2 ;;
    --no-docker) docker=no; shift ;;
    --burners) burners=${2:?--burners needs a number}; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "race-hunt: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$rounds$burners" in
  *[!0-9]*) echo "race-hunt: error: -n and --burners take whole numbers" >&2; exit 2 ;;
esac

if [ "$docker" = no ]; then
  unset DOCKER_HOST CCCI_SWARM_MANAGER CCCI_SWARM_WORKER
fi

out=${RACE_HUNT_DIR:-$(mktemp -d /tmp/race-hunt.XXXXXX)}
mkdir -p "$out"
echo "race-hunt: $rounds round(s), $burners burner(s), Docker ${DOCKER_HOST:-unset}; logs in $out"

# The README's test command, built once so the rounds time the tests, not the compiler.
cargo test --locked --features etcd --no-run "${extra[@]}" >"$out/build.log" 2>&1 || {
  echo "race-hunt: error: the build failed; see $out/build.log" >&2
  exit 1
}

pids=()
stop_burners() {
  local pid
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap stop_burners EXIT
for _ in $(seq "$burners"); do
  # A busy loop in a shell of its own: one core's worth of CPU, nothing else.
  bash -c 'while :; do :; done' &
  pids+=($!)
done

failed_rounds=0
for round in $(seq "$rounds"); do
  log="$out/round-$round.log"
  start=$(date +%s)
  status=0
  # The round's CPU time too (user + system, the tests' processes included), so a reader can
  # scale the wall time to another machine.
  if [ -x /usr/bin/time ]; then
    /usr/bin/time -f '%U %S' -o "$out/round-$round.cpu" \
      cargo test --locked --features etcd "${extra[@]}" >"$log" 2>&1 || status=$?
  else
    cargo test --locked --features etcd "${extra[@]}" >"$log" 2>&1 || status=$?
  fi
  secs=$(($(date +%s) - start))
  cpu=$(awk 'END { if (NF == 2) printf ", %d s of CPU", $1 + $2 }' "$out/round-$round.cpu" 2>/dev/null || true)
  # libtest's failure lines: `test drone::x ... FAILED`, and a test binary that did not finish.
  failures=$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$log" | sort -u)
  if [ "$status" -eq 0 ]; then
    echo "round $round: passed ($secs s$cpu)"
  else
    failed_rounds=$((failed_rounds + 1))
    echo "round $round: FAILED, exit $status ($secs s$cpu), log $log"
    if [ -n "$failures" ]; then
      printf '  %s\n' $failures
    else
      echo "  (no test reported FAILED: see the log's end)"
    fi
  fi
done

stop_burners
echo
echo "race-hunt: $((rounds - failed_rounds)) of $rounds round(s) passed"
if [ "$failed_rounds" -gt 0 ]; then
  echo "failed tests, with the rounds they failed in:"
  for round in $(seq "$rounds"); do
    sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$out/round-$round.log" | sed "s/\$/ $round/"
  done | sort | awk '{r[$1] = r[$1] (r[$1] ? "," : "") $2} END {for (t in r) print "  " t ": round " r[t]}' | sort
  exit 1
fi
