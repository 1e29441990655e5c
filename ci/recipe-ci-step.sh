#!/bin/sh
# The recipe-CI step of .drone.yml: one supervised run of the recipe under test.
#
#   sh ci/recipe-ci-step.sh [COMMAND [ARGS...]]   (default: sh ci/recipe-tests.sh)
#
# Drone's exec runner writes a step's commands into a script for `/bin/sh -e` and, when a build
# is cancelled, SIGKILLs that shell only; when the runner itself dies, nobody kills the shell.
# .drone.yml execs this script from that shell, so this shell is the step shell and its parent
# is the runner. The run is tied to both (CCCI_TIE_TO, a comma-separated list of ancestors):
# ccci-run watches each through a pidfd and tears the run down the moment either dies, however
# many layers stand between them. Run by hand, the run is tied to this shell and the one that
# started it. Other cancellation paths send TERM to the shell: the trap passes it to ccci-run's
# process group. --expect-parent closes the start race (a shell that died before ccci-run armed
# its guards).
#
# The run id is ccci-run's default: the build's repository and number from DRONE_REPO and
# DRONE_BUILD_NUMBER (`coop-cloud.custom-html.120`). One runner serves every recipe repository
# and each numbers its builds from 1, so the number alone would make two repositories' builds
# share one run directory.
#
# Whatever ccci-run needs beyond the PR (its directories, Docker, etcd, its bounds) comes from
# its configuration file: the runner passes only PATH, USER, a HOME in the build's workspace
# (removed with it, maybe mid-teardown) and DRONE_*/CI_* to a step.
set -eu

# HOME is the runner's user's own home, whichever user the runner runs as (root's /root is no
# other user's to read: docker would warn on every call that it cannot open its config there).
home=
if command -v getent >/dev/null 2>&1; then
  home=$(getent passwd "$(id -u)" | cut -d: -f6)
fi
if [ -n "$home" ] && [ -d "$home" ]; then
  HOME=$home
  export HOME
fi

: "${CCCI_BIN:=ccci-run}"
: "${RECIPE:=${DRONE_REPO_NAME:?set RECIPE or DRONE_REPO_NAME}}"
[ "$#" -gt 0 ] || set -- sh ci/recipe-tests.sh
# The runner's pid is left out when this shell's parent is pid 1: then the runner is gone
# already or a container's init runs the step, and pid 1 itself never exits.
if [ -z "${CCCI_TIE_TO:-}" ]; then
  CCCI_TIE_TO=$$
  [ "$PPID" -le 1 ] || CCCI_TIE_TO="$CCCI_TIE_TO,$PPID"
fi
export CCCI_TIE_TO

# Which PR: a pull_request build names it in DRONE_PULL_REQUEST; a custom build (how a
# `!testme` comment arrives: `drone build create --param CCCI_PR=<number>`) carries it as the
# CCCI_PR parameter. A custom build without one is a ref build only when RECIPE_REF says so:
# falling through to the default branch would test the wrong code and report it as the PR's.
pr="${DRONE_PULL_REQUEST:-${CCCI_PR:-}}"
if [ -z "$pr" ] && [ "${DRONE_BUILD_EVENT:-}" = custom ] && [ -z "${RECIPE_REF:-}" ]; then
  echo "ccci-run step: a custom build needs the PR number as parameter CCCI_PR (or RECIPE_REF for a ref build)" >&2
  exit 2
fi

# setsid makes ccci-run the leader of a process group of its own; it stays this shell's child.
if [ -n "$pr" ]; then
  setsid "$CCCI_BIN" run --expect-parent $$ --recipe "$RECIPE" --pr "$pr" -- "$@" &
else
  setsid "$CCCI_BIN" run --expect-parent $$ --recipe "$RECIPE" ${RECIPE_REF:+--ref "$RECIPE_REF"} -- "$@" &
fi
pid=$!
trap 'kill -s TERM -- "-$pid" 2>/dev/null || true' TERM INT HUP

status=0
wait "$pid" || status=$?
# A trapped signal cuts the first wait short: wait again for ccci-run's own status.
while kill -0 "$pid" 2>/dev/null; do
  status=0
  wait "$pid" || status=$?
done
exit "$status"
