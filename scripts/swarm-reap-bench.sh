#!/usr/bin/env bash
# Time until a run app's stack is gone on every node of the two-node swarm
# (scripts/swarm-two-node.sh), by hand, for the ways of removing it that a reap could use:
#
#   stack-rm   `docker stack rm`, then polling each node's engine until the stack's container
#              is gone, then `docker volume rm` on each node (what an operator does today)
#   job        the stack's services removed through the manager, then a one-shot global job
#              (mode global-job) whose task on each node force-removes the stack's containers
#              and volumes through that node's own engine socket and exits 0 only when nothing
#              of the stack is left there; completion read from the manager's task list
#
#   scripts/swarm-reap-bench.sh [ROUNDS] [term|ignore-term]
#
# Each round also redeploys the stack at once after each way of removing it, and says what each
# node's new task finds in its volume (written-by-1 is the previous run's file).
#
# Measured with it (Docker 20.10.24, API 1.41, 2 cores): stack-rm 6.0-6.3 s until gone on both
# nodes (16.2-16.5 s for an app that ignores SIGTERM); job 1.1-1.7 s (1.3-1.5 s ignoring
# SIGTERM: the task's `rm -f` does not wait for it), its completion on each node shown by the
# manager's task list. What a global job does besides, by hand on the same swarm:
# - a node cut off after the job is created keeps its task `Assigned` (the manager marks the
#   node Down after ~12 s); once the link is back the task runs and completes ~7 s later;
# - a node already Down (or drained) when the job is created never gets a task, not even after
#   it is back: `docker service update --force` (a new job iteration) or a new job reaches it;
# - failed or rejected tasks are retried forever, --restart-condition none notwithstanding
#   (9 tasks in 4 s): whoever deploys the job must remove it;
# - removing the job leaves its exited task container on every node (still there 20 s and
#   50 min later): the next job must remove its predecessors' containers;
# - busybox cannot reach a unix socket (its wget speaks TCP only, `nc -f` fails with ENXIO), so
#   the task needs a docker CLI (ccci-test/docker-cli here, docker:cli on a real fleet) or
#   `busybox chroot` into a bind mount of the node's / to run the node's own docker (0.7 s).
#
# The stack: two replicas with max_replicas_per_node 1 (one task per node), a named volume each
# task writes to, a secret, a config and an overlay network. Times are seconds from the first
# removal call; a node's container (volume) time is the first poll that no longer lists it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

rounds=${1:-3}
term=${2:-term}
base=${CCCI_SWARM_BASE:-/tmp/ccci-swarm2}
M=unix://$base/n1/docker.sock
W=unix://$base/n2/docker.sock
# The path of every node's own engine socket, the same on each (see swarm-two-node.sh).
node_sock=$base/node/docker.sock
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

m() { docker -H "$M" "$@"; }
node() { local n=$1; shift; if [ "$n" = 1 ]; then docker -H "$M" "$@"; else docker -H "$W" "$@"; fi; }
now() { echo "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

if [ "$term" = ignore-term ]; then
  command='trap "" TERM; ls /data; date > /data/written-by-$$RUN; while :; do sleep 1; done'
  init=false
else
  command='ls /data; date > /data/written-by-$$RUN; exec sleep 100000'
  init=true
fi
printf 's3cret\n' >"$work/secret.txt"
printf 'conf\n' >"$work/conf.txt"
cat >"$work/stack.yml" <<EOF
version: "3.8"
services:
  app:
    image: ccci-test/busybox:latest
    command: ["sh", "-c", '$command']
    init: $init
    environment: {RUN: "\${RUN:-1}"}
    networks: [internal]
    volumes: [data:/data]
    secrets: [db_password]
    configs: [{source: app_conf, target: /etc/app.conf}]
    deploy:
      endpoint_mode: dnsrr
      replicas: 2
      placement: {max_replicas_per_node: 1}
networks:
  internal: {driver: overlay}
volumes:
  data: {}
secrets:
  db_password: {file: ./secret.txt}
configs:
  app_conf: {file: ./conf.txt}
EOF

label() { echo "label=com.docker.stack.namespace=$1"; }

deploy() { # deploy STACK RUN: both tasks of this deploy's service running, one per node
  (cd "$work" && RUN=$2 m stack deploy --detach=true --resolve-image never -c stack.yml "$1" >/dev/null)
  # A container of the previous deploy may still run: count only this service's.
  local i service
  service="label=com.docker.swarm.service.id=$(m service inspect -f '{{.ID}}' "$1_app")"
  for i in $(seq 1 600); do
    [ "$(node 1 ps -q --filter "$service" | wc -l)$(node 2 ps -q --filter "$service" | wc -l)" = 11 ] && return
    sleep 0.1
  done
  echo "$1: tasks not running on both nodes" >&2
  return 1
}

# Poll both nodes until neither lists a container of STACK; prints "c1 c2" times from T0.
wait_containers_gone() {
  local stack=$1 t0=$2 c1= c2= i
  for i in $(seq 1 1200); do
    [ -z "$c1" ] && [ -z "$(node 1 ps -aq --filter "$(label "$stack")")" ] && c1=$(since "$t0" "$(now)")
    [ -z "$c2" ] && [ -z "$(node 2 ps -aq --filter "$(label "$stack")")" ] && c2=$(since "$t0" "$(now)")
    [ -n "$c1" ] && [ -n "$c2" ] && break
    sleep 0.05
  done
  echo "${c1:-never} ${c2:-never}"
}

wait_volumes_gone() {
  local stack=$1 t0=$2 v1= v2= i
  for i in $(seq 1 1200); do
    [ -z "$v1" ] && [ -z "$(node 1 volume ls -q --filter name="${stack}_")" ] && v1=$(since "$t0" "$(now)")
    [ -z "$v2" ] && [ -z "$(node 2 volume ls -q --filter name="${stack}_")" ] && v2=$(since "$t0" "$(now)")
    [ -n "$v1" ] && [ -n "$v2" ] && break
    sleep 0.05
  done
  echo "${v1:-never} ${v2:-never}"
}

bench_stack_rm() {
  local stack=$1 t0 gone vols
  deploy "$stack" 1
  t0=$(now)
  m stack rm "$stack" >/dev/null
  gone=$(wait_containers_gone "$stack" "$t0")
  node 1 volume rm "${stack}_data" >/dev/null
  node 2 volume rm "${stack}_data" >/dev/null
  vols=$(wait_volumes_gone "$stack" "$t0")
  echo "stack-rm $term: containers gone node1 ${gone% *} s, node2 ${gone#* } s; volumes removed on each node by then: node1 ${vols% *} s, node2 ${vols#* } s"
}

# The global job that cleans STACK on every node: its task force-removes the stack's containers
# on its node, then its volumes, and succeeds only if nothing of the stack is listed there.
clean_job() {
  local stack=$1
  local script="
    f=label=com.docker.stack.namespace=$stack
    docker ps -aq --filter \$f | xargs -r docker rm -f >/dev/null
    docker volume ls -q --filter \$f | xargs -r docker volume rm >/dev/null
    left=\"\$(docker ps -aq --filter \$f) \$(docker volume ls -q --filter \$f)\"
    echo \"\$(hostname) left: [\$left]\"
    [ \"\$left\" = ' ' ]"
  m service create -d --no-resolve-image --mode global-job --name "ccci-clean-$stack" \
    --label "ccci.clean=$stack" --restart-condition none --restart-max-attempts 0 \
    --mount "type=bind,source=$node_sock,target=/var/run/docker.sock" \
    ccci-test/docker-cli:latest sh -c "$script" >/dev/null
}

# Poll the manager's task list until every node's task of the job is Complete (or failed);
# prints "state1@t state2@t" per node name.
wait_job() {
  local job=$1 t0=$2 i line states
  for i in $(seq 1 1200); do
    states=$(m service ps --format '{{.Node}}={{.CurrentState}}' "$job" 2>/dev/null | sed 's/ .*//' | sort | tr '\n' ' ')
    case "$states" in
      *swarm2-node1=Complete*swarm2-node2=Complete*) echo "complete on both at $(since "$t0" "$(now)") s"; return ;;
      *Failed*|*Rejected*) echo "failed: $states at $(since "$t0" "$(now)") s"; return ;;
    esac
    sleep 0.05
  done
  echo "not complete: $states"
}

bench_job() {
  local stack=$1 t0 gone vols job_done
  deploy "$stack" 1
  t0=$(now)
  m service ls -q --filter "$(label "$stack")" | xargs -r docker -H "$M" service rm >/dev/null
  clean_job "$stack"
  job_done=$(wait_job "ccci-clean-$stack" "$t0")
  gone=$(wait_containers_gone "$stack" "$t0")
  vols=$(wait_volumes_gone "$stack" "$t0")
  m service rm "ccci-clean-$stack" >/dev/null
  for kind in secret config network; do
    m $kind ls -q --filter "$(label "$stack")" | xargs -r docker -H "$M" $kind rm >/dev/null 2>&1 || true
  done
  echo "job $term: job $job_done; containers gone node1 ${gone% *} s, node2 ${gone#* } s; volumes node1 ${vols% *} s, node2 ${vols#* } s"
}

# Remove STACK by MODE, then deploy it again at once as run 2: how long until both of run 2's
# tasks run, and whether each node's task sees run 1's file in its volume.
bench_redeploy() {
  local mode=$1 stack=$2 t0 n c data report=
  deploy "$stack" 1
  if [ "$mode" = stack-rm ]; then
    m stack rm "$stack" >/dev/null
    # What stack rm leaves on the manager at once would make the deploy fail ("network not
    # found"); wait for the manager's own network to go, as a reap on the manager does.
    while m network ls -q --filter "$(label "$stack")" | grep -q .; do sleep 0.05; done
  else
    m service ls -q --filter "$(label "$stack")" | xargs -r docker -H "$M" service rm >/dev/null
    clean_job "$stack"
    wait_job "ccci-clean-$stack" "$(now)" >/dev/null
    m service rm "ccci-clean-$stack" >/dev/null
    for kind in secret config network; do
      m $kind ls -q --filter "$(label "$stack")" | xargs -r docker -H "$M" $kind rm >/dev/null 2>&1 || true
    done
    while m network ls -q --filter "$(label "$stack")" | grep -q .; do sleep 0.05; done
  fi
  t0=$(now)
  deploy "$stack" 2
  local service
  service="label=com.docker.swarm.service.id=$(m service inspect -f '{{.ID}}' "${stack}_app")"
  for n in 1 2; do
    c=$(node "$n" ps -q --filter "$service")
    data=$(node "$n" exec "$c" ls /data | tr '\n' ' ')
    report="$report node$n /data: [${data% }]"
  done
  echo "redeploy after $mode $term: run 2 running on both nodes $(since "$t0" "$(now)") s after its deploy;$report"
  m stack rm "$stack" >/dev/null
  wait_containers_gone "$stack" "$(now)" >/dev/null
  node 1 volume rm -f "${stack}_data" >/dev/null
  node 2 volume rm -f "${stack}_data" >/dev/null
}

for r in $(seq 1 "$rounds"); do
  bench_stack_rm "bench_rm$r"
  bench_job "bench_job$r"
  bench_redeploy stack-rm "bench_rdrm$r"
  bench_redeploy job "bench_rdjob$r"
done
# Whatever a round left (networks and the like that stack rm removes asynchronously).
for r in $(seq 1 "$rounds"); do
  for s in "bench_rm$r" "bench_job$r" "bench_rdrm$r" "bench_rdjob$r"; do
    m stack rm "$s" >/dev/null 2>&1 || true
  done
done
