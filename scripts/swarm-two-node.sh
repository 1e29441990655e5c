#!/usr/bin/env bash
# A throwaway two-node Docker swarm on one machine, as root, for the multi-node tests: each node
# is a network namespace with a dockerd of its own (socket, data root, exec root, pidfile,
# cgroup parent), the two joined by a veth pair whose addresses exist only inside them. Node 1
# is the manager, node 2 a worker; no registry: a busybox image is imported on both, and an
# image with busybox and the docker CLI (ccci-test/docker-cli) where a static docker CLI is on
# PATH (Docker's own builds are static).
#
#   scripts/swarm-two-node.sh start    # prints CCCI_SWARM_MANAGER=… and CCCI_SWARM_WORKER=…
#   scripts/swarm-two-node.sh status   # what runs, the swarm's nodes, the link
#   scripts/swarm-two-node.sh cut [link|drop]   # cut node 2 off (link down, or nftables drops)
#   scripts/swarm-two-node.sh heal     # undo either cut
#   scripts/swarm-two-node.sh stop-worker   # stop node 2's dockerd only (`start` brings it back)
#   scripts/swarm-two-node.sh stop     # stops its daemons by pidfile, deletes its namespaces
#   scripts/swarm-two-node.sh purge    # stop, then remove the base directory (swarm state too)
#
# CCCI_SWARM_BASE (default /tmp/ccci-swarm2) holds everything it creates; the namespaces are
# named after it. `start` is idempotent: it starts what is not running and joins what is not
# joined. Nothing is created in the machine's own network namespace, and neither namespace has
# a default route: no packet leaves for an address outside the machine.
#
# Every node also listens on the same path, $base/node/docker.sock, in a tmpfs private to its
# own mount namespace: a global service that bind-mounts that path reaches its own node's
# engine, as /var/run/docker.sock does on a real fleet.
set -euo pipefail

base=${CCCI_SWARM_BASE:-/tmp/ccci-swarm2}
image=ccci-test/busybox:latest
cli_image=ccci-test/docker-cli:latest
# Addresses of the link (inside the namespaces only) and the pool of the swarm's overlays.
net=10.214.0
pool=10.215.0.0/16
tag=ccs$(printf '%s' "$base" | sha1sum | cut -c1-6)
ns() { echo "$tag-n$1"; }
veth() { echo "$tag-v$1"; }
addr() { echo "$net.$1"; }
sock() { echo "$base/n$1/docker.sock"; }
pidfile() { echo "$base/n$1/docker.pid"; }
cgroup_parent() { echo "$tag-n$1"; }

log() { printf 'swarm-two-node: %s\n' "$*" >&2; }
d() { # d N args...: the docker CLI against node N
  local n=$1
  shift
  docker -H "unix://$(sock "$n")" "$@"
}

need_root() {
  [ "$(id -u)" = 0 ] || { log "must run as root (network namespaces, mounts)"; exit 1; }
}

install_tools() {
  local need=()
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v busybox >/dev/null || need+=(busybox-static)
  command -v ip >/dev/null || need+=(iproute2)
  command -v nft >/dev/null || need+=(nftables)
  command -v sha1sum >/dev/null || need+=(coreutils)
  if [ "${#need[@]}" -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}

running() { # running N: node N's dockerd is alive
  local f
  f=$(pidfile "$1")
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

answers() { d "$1" version >/dev/null 2>&1; }

ns_exists() { [ -e "/var/run/netns/$(ns "$1")" ]; }

# The two namespaces and the veth pair between them, unless they are there already.
make_network() {
  local n
  for n in 1 2; do
    if ! ns_exists "$n"; then
      ip netns add "$(ns "$n")"
      ip -n "$(ns "$n")" link set lo up
    fi
  done
  if ! ip -n "$(ns 1)" link show "$(veth 1)" >/dev/null 2>&1; then
    # A half-made pair (node 2's end left behind) goes first.
    ip -n "$(ns 2)" link del "$(veth 2)" 2>/dev/null || true
    ip link add "$(veth 1)" netns "$(ns 1)" type veth peer name "$(veth 2)" netns "$(ns 2)"
    for n in 1 2; do
      ip -n "$(ns "$n")" addr add "$(addr "$n")/24" dev "$(veth "$n")"
      ip -n "$(ns "$n")" link set "$(veth "$n")" up
    done
  fi
}

# What /sys/fs/cgroup holds in this mount namespace, as "fstype mountpoint options" lines, in
# mount order: `ip netns exec` mounts a fresh /sys without it, and dockerd needs it again.
cgroup_mounts() {
  awk '$2 == "/sys/fs/cgroup" || index($2, "/sys/fs/cgroup/") == 1 { print $3, $2, $4 }' /proc/self/mounts
}

# Start node N's dockerd inside its namespace (which `ip netns exec` also gives a mount
# namespace of its own) and a UTS namespace with hostname swarm2-nodeN: the cgroup hierarchy
# mounted again, a private tmpfs on $base/node for the node-local socket path, then dockerd.
start_daemon() {
  local n=$1 dir="$base/n$1"
  mkdir -p "$dir" "$base/node"
  local inner='
    set -e
    while read -r fstype mountpoint options; do
      mkdir -p "$mountpoint"
      mount -t "$fstype" -o "$options" "$fstype" "$mountpoint"
    done <<EOF
$CGROUP_MOUNTS
EOF
    mount -t tmpfs -o mode=0755,size=1m ccci-node "$NODE_DIR"
    hostname "$NODE_NAME"
    exec dockerd "$@"'
  local flags=(--host "unix://$(sock "$n")" --host "unix://$base/node/docker.sock"
    --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$(pidfile "$n")"
    --cgroup-parent "$(cgroup_parent "$n")" --shutdown-timeout 3)
  if [ "${CCCI_DOCKER_PLAIN:-0}" = 1 ]; then
    flags+=(--iptables=false --storage-driver=vfs)
  fi
  rm -f "$(sock "$n")"
  CGROUP_MOUNTS=$(cgroup_mounts) NODE_DIR="$base/node" NODE_NAME="swarm2-node$n" \
    DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1 \
    setsid ip netns exec "$(ns "$n")" unshare --uts sh -c "$inner" dockerd "${flags[@]}" \
    >"$dir/dockerd.log" 2>&1 </dev/null &
  echo "$!" >"$dir/launcher.pid"
}

wait_ready() {
  local n=$1 pid i
  pid=$(cat "$base/n$n/launcher.pid")
  for i in $(seq 1 300); do
    answers "$n" && return 0
    if ! kill -0 "$pid" 2>/dev/null; then
      log "node $n: dockerd exited; its log follows"
      cat "$base/n$n/dockerd.log" >&2
      return 1
    fi
    sleep 0.1
  done
  log "node $n: dockerd did not answer within 30 s"
  return 1
}

swarm_state() { d "$1" info --format '{{.Swarm.LocalNodeState}}' 2>/dev/null; }

make_swarm() {
  if [ "$(swarm_state 1)" != active ]; then
    d 1 swarm init --advertise-addr "$(addr 1)" --listen-addr "$(addr 1):2377" \
      --default-addr-pool "$pool" >/dev/null
  fi
  if [ "$(d 1 info --format '{{.Swarm.ControlAvailable}}')" != true ]; then
    log "node 1 is in a swarm but not its manager"
    return 1
  fi
  local state
  state=$(swarm_state 2)
  if [ "$state" = active ]; then
    # Joined, but to this swarm? Its manager must list it.
    local id
    id=$(d 2 info --format '{{.Swarm.NodeID}}')
    if d 1 node inspect "$id" >/dev/null 2>&1; then
      return 0
    fi
    log "node 2 is in another swarm; it leaves it"
    d 2 swarm leave --force >/dev/null
    state=inactive
  fi
  if [ "$state" != inactive ]; then
    # pending, error or locked: start its membership again.
    d 2 swarm leave --force >/dev/null 2>&1 || true
  fi
  # Nodes of an earlier join that are down now are dropped from the manager's list.
  d 1 node ls --filter role=worker --format '{{.ID}} {{.Status}}' |
    while read -r id status; do
      [ "$status" = Down ] && d 1 node rm --force "$id" >/dev/null 2>&1 || true
    done
  d 2 swarm join --token "$(d 1 swarm join-token -q worker)" --advertise-addr "$(addr 2)" \
    --listen-addr "$(addr 2):2377" "$(addr 1):2377" >/dev/null
}

# Node 2 is Ready in the manager's list.
wait_worker_ready() {
  local id i
  id=$(d 2 info --format '{{.Swarm.NodeID}}')
  for i in $(seq 1 300); do
    [ "$(d 1 node inspect -f '{{.Status.State}}' "$id" 2>/dev/null)" = ready ] && return 0
    sleep 0.1
  done
  log "node 2 did not become ready in the manager's list within 30 s"
  return 1
}

# A rootfs tarball of busybox (with the applets the tests use) and, when `with_cli` is given,
# the docker CLI at /usr/local/bin/docker; made once.
rootfs_tar() { # rootfs_tar NAME [with_cli]
  local tar="$base/$1.tar"
  [ -f "$tar" ] && { echo "$tar"; return; }
  local rootfs="$base/$1.rootfs"
  rm -rf "$rootfs"
  mkdir -p "$rootfs/bin" "$rootfs/tmp" "$rootfs/etc" "$rootfs/usr/local/bin"
  cp "$(command -v busybox)" "$rootfs/bin/busybox"
  local applet
  for applet in sh sleep cat echo ls true false kill ps wget nc rm mkdir touch date printf test \
    chroot grep wc xargs seq; do
    ln -sf busybox "$rootfs/bin/$applet"
  done
  if [ "${2:-}" = with_cli ]; then
    cp "$(static_docker_cli)" "$rootfs/usr/local/bin/docker"
  fi
  tar -C "$rootfs" -cf "$tar.part" .
  mv "$tar.part" "$tar"
  rm -rf "$rootfs"
  echo "$tar"
}

# A statically linked docker CLI on PATH (Docker's own builds are; Debian's is not), or nothing.
static_docker_cli() {
  local cli
  for cli in $(type -ap docker); do
    if ! ldd "$cli" >/dev/null 2>&1; then
      echo "$cli"
      return 0
    fi
  done
  return 1
}

import_image() { # import_image NODE IMAGE TARBALL-NAME [with_cli]
  local n=$1 name=$2
  d "$n" image inspect "$name" >/dev/null 2>&1 && return
  d "$n" import --change 'CMD ["/bin/sh"]' --change 'ENV PATH=/usr/local/bin:/bin' \
    "$(rootfs_tar "$3" "${4:-}")" "$name" >/dev/null
}

# Both images on node N: the busybox image, and (where a static docker CLI is at hand) an
# image holding that CLI too, standing in for docker:cli (no registry here) for anything that
# must talk to its own node's engine from a task.
import_images() {
  import_image "$1" "$image" busybox
  if static_docker_cli >/dev/null; then
    import_image "$1" "$cli_image" docker-cli with_cli
  fi
}

start() {
  need_root
  install_tools
  mkdir -p "$base"
  local t0=$EPOCHREALTIME n
  make_network
  for n in 1 2; do
    if running "$n"; then
      log "node $n: dockerd already running (pid $(cat "$(pidfile "$n")"))"
    else
      start_daemon "$n"
    fi
  done
  for n in 1 2; do
    running "$n" && answers "$n" || wait_ready "$n"
  done
  make_swarm
  wait_worker_ready
  import_images 1
  import_images 2
  log "ready in $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }') s: manager $(addr 1) ($(ns 1)), worker $(addr 2) ($(ns 2)), images $image$(static_docker_cli >/dev/null && echo " $cli_image")"
  echo "CCCI_SWARM_MANAGER=unix://$(sock 1)"
  echo "CCCI_SWARM_WORKER=unix://$(sock 2)"
}

stop_daemon() {
  local n=$1 f pid
  f=$(pidfile "$n")
  if running "$n"; then
    pid=$(cat "$f")
    kill "$pid"
    for _ in $(seq 1 300); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      kill -9 "$pid"
    fi
    log "node $n: dockerd stopped (pid $pid)"
  fi
  rm -f "$f"
}

stop() {
  need_root
  local n
  for n in 1 2; do
    stop_daemon "$n"
  done
  # Whatever is still in a namespace (a shim, a container's process) belongs to these nodes.
  for n in 1 2; do
    if ns_exists "$n"; then
      local pids
      pids=$(ip netns pids "$(ns "$n")" 2>/dev/null || true)
      if [ -n "$pids" ]; then
        # shellcheck disable=SC2086
        kill -9 $pids 2>/dev/null || true
      fi
      ip netns del "$(ns "$n")"
    fi
  done
  # The containers' cgroups, under each node's cgroup parent in every hierarchy.
  local dir
  for n in 1 2; do
    for dir in /sys/fs/cgroup/*/"$(cgroup_parent "$n")" /sys/fs/cgroup/"$(cgroup_parent "$n")"; do
      [ -d "$dir" ] || continue
      find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
  done
  # Anything mounted under the base from this mount namespace (nothing, normally).
  awk -v base="$base/" 'index($2, base) == 1 { print $2 }' /proc/mounts | sort -r |
    while read -r mountpoint; do umount -l "$mountpoint" 2>/dev/null || true; done
}

purge() {
  stop
  rm -rf "$base"
  log "removed $base"
}

cut() {
  need_root
  case "${1:-link}" in
    link) ip -n "$(ns 2)" link set "$(veth 2)" down ;;
    drop)
      ip netns exec "$(ns 2)" nft -f - <<EOF
table inet ccci_cut
delete table inet ccci_cut
table inet ccci_cut {
  chain in { type filter hook input priority -300; policy accept; iifname "$(veth 2)" drop; }
  chain out { type filter hook output priority -300; policy accept; oifname "$(veth 2)" drop; }
}
EOF
      ;;
    *) echo "usage: $0 cut [link|drop]" >&2; exit 2 ;;
  esac
  log "node 2 cut off ($1)"
}

heal() {
  need_root
  ip netns exec "$(ns 2)" nft delete table inet ccci_cut 2>/dev/null || true
  ip -n "$(ns 2)" link set "$(veth 2)" up
  log "node 2 healed"
}

status() {
  local n state=0
  for n in 1 2; do
    if running "$n"; then
      echo "node $n: dockerd pid $(cat "$(pidfile "$n")"), $(addr "$n") in $(ns "$n"), socket $(sock "$n"), swarm $(swarm_state "$n" || echo '?')"
    else
      echo "node $n: not running"
      state=1
    fi
  done
  if ns_exists 2; then
    local link=up
    ip -n "$(ns 2)" -br link show "$(veth 2)" 2>/dev/null | grep -q ' UP ' || link=down
    ip netns exec "$(ns 2)" nft list table inet ccci_cut >/dev/null 2>&1 && link="$link, drops in place"
    echo "link to node 2: $link"
  fi
  if running 1; then
    d 1 node ls --format '  {{.Hostname}} {{.ManagerStatus}} {{.Status}} {{.Availability}}' 2>/dev/null || true
  fi
  return "$state"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  purge) purge ;;
  status) status ;;
  cut) cut "${2:-link}" ;;
  heal) heal ;;
  stop-worker) need_root; stop_daemon 2 ;;
  *) echo "usage: $0 start|stop|purge|status|cut [link|drop]|heal|stop-worker" >&2; exit 2 ;;
esac
