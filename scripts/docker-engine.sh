#!/usr/bin/env bash
# A throwaway Docker Engine in swarm mode for the test suite: its own socket, data and exec
# roots, no registry (a busybox image is imported from Debian's busybox-static).
#
#   scripts/docker-engine.sh start   # prints the DOCKER_HOST to export
#   scripts/docker-engine.sh stop    # stops it by its pid
#
# CCCI_DOCKER_BASE (default /tmp/ccci-docker) holds everything it creates. Besides its socket
# the engine listens on a loopback TCP port with TLS, clients verified against a CA made here:
# $base/tls-host holds its DOCKER_HOST (tcp://127.0.0.1:PORT), $base/tls/client the
# DOCKER_CERT_PATH (ca.pem, cert.pem, key.pem) of a client it accepts.
set -euo pipefail

base=${CCCI_DOCKER_BASE:-/tmp/ccci-docker}
sock="$base/docker.sock"
pidfile="$base/docker.pid"
image=ccci-test/busybox:latest
export DOCKER_HOST="unix://$sock"

log() { printf 'docker-engine: %s\n' "$*" >&2; }

install_engine() {
  if command -v dockerd >/dev/null && command -v busybox >/dev/null && command -v openssl >/dev/null; then
    return
  fi
  log "installing docker.io, busybox-static and openssl"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io busybox-static openssl >/dev/null
}

running() {
  [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

# Wait until the daemon answers; $1 is its pid (the pidfile appears only once it is up).
wait_ready() {
  local pid=$1 i
  for i in $(seq 1 300); do
    if docker version >/dev/null 2>&1; then
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      log "dockerd exited; its log follows"
      cat "$base/dockerd.log" >&2
      return 1
    fi
    sleep 0.1
  done
  log "dockerd did not answer within 30 s"
  return 1
}

# A CA, a server certificate for 127.0.0.1 and a client certificate, all EC P-256; made once.
make_certs() {
  local tls="$base/tls"
  [ -f "$tls/client/key.pem" ] && return
  rm -rf "$tls"
  mkdir -p "$tls/client"
  local key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
  openssl req -x509 "${key[@]}" -days 3650 -subj "/CN=ccci-run test CA" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$tls/ca-key.pem" -out "$tls/ca.pem" 2>/dev/null
  sign() { # $1 name, $2 CN, $3 extensions
    openssl req "${key[@]}" -subj "/CN=$2" -keyout "$tls/$1-key.pem" -out "$tls/$1.csr" 2>/dev/null
    printf '%s\n' "$3" >"$tls/$1.ext"
    openssl x509 -req -in "$tls/$1.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca-key.pem" \
      -CAcreateserial -days 3650 -extfile "$tls/$1.ext" -out "$tls/$1-cert.pem" 2>/dev/null
  }
  sign server 127.0.0.1 "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
  sign client ccci-run-test "extendedKeyUsage=clientAuth"
  cp "$tls/ca.pem" "$tls/client/ca.pem"
  cp "$tls/client-cert.pem" "$tls/client/cert.pem"
  cp "$tls/client-key.pem" "$tls/client/key.pem"
}

# A loopback port nothing listens on.
free_port() {
  local port
  for port in $(seq 23760 23999); do
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  log "no free loopback port in 23760-23999"
  return 1
}

start() {
  install_engine
  mkdir -p "$base"
  if running; then
    log "already running (pid $(cat "$pidfile"))"
  else
    make_certs
    local tls_host
    tls_host="tcp://127.0.0.1:$(free_port)"
    local flags=(--host "$DOCKER_HOST" --host "$tls_host" --tlsverify
      --tlscacert "$base/tls/ca.pem" --tlscert "$base/tls/server-cert.pem"
      --tlskey "$base/tls/server-key.pem" --data-root "$base/data" --exec-root "$base/exec"
      --pidfile "$pidfile")
    echo "$tls_host" >"$base/tls-host"
    # Elsewhere overlayfs or iptables may be missing; fall back to the plainest set-up.
    if [ "${CCCI_DOCKER_PLAIN:-0}" = 1 ]; then
      flags+=(--iptables=false --bridge=none --storage-driver=vfs)
    fi
    DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1 setsid dockerd "${flags[@]}" \
      >"$base/dockerd.log" 2>&1 </dev/null &
    wait_ready $!
  fi
  # A daemon that was already in a swarm says "pending" while it rejoins it: wait that out, and
  # make a swarm only where there is none.
  local state i
  for i in $(seq 1 300); do
    state=$(docker info --format '{{.Swarm.LocalNodeState}}' 2>/dev/null || true)
    [ "$state" = pending ] || [ -z "$state" ] || break
    sleep 0.1
  done
  if [ "$state" = inactive ]; then
    docker swarm init --advertise-addr 127.0.0.1 >/dev/null
  elif [ "$state" != active ]; then
    log "the engine's swarm is ${state:-unknown}, not active"
    return 1
  fi
  if ! docker image inspect "$image" >/dev/null 2>&1; then
    local rootfs="$base/rootfs"
    rm -rf "$rootfs"
    mkdir -p "$rootfs/bin" "$rootfs/tmp" "$rootfs/etc"
    cp "$(command -v busybox)" "$rootfs/bin/busybox"
    local applet
    for applet in sh sleep cat echo ls true false kill ps wget nc; do
      ln -sf busybox "$rootfs/bin/$applet"
    done
    tar -C "$rootfs" -cf "$base/rootfs.tar" .
    docker import --change 'CMD ["/bin/sh"]' "$base/rootfs.tar" "$image" >/dev/null
  fi
  log "ready: swarm manager with image $image"
  echo "DOCKER_HOST=$DOCKER_HOST"
}

stop() {
  if running; then
    local pid
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 1 200); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    rm -f "$base/tls-host"
    log "stopped (pid $pid)"
  fi
  # Swarm leaves network namespaces and overlay mounts under the base; let go of them.
  awk -v base="$base/" 'index($2, base) == 1 { print $2 }' /proc/mounts | sort -r |
    while read -r mountpoint; do umount -l "$mountpoint" 2>/dev/null || true; done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
