#!/bin/sh
# A minimal Debian bookworm root with systemd and dbus, for tests that boot the shipped units
# under a real systemd (tests/integration/systemd_host.rs, with systemd-nspawn).
#
#   scripts/systemd-root.sh TARBALL   build TARBALL (zstd) unless it is there; print its path
#
# mmdebstrap makes it from the mirror apt already uses (about a minute, 155 MB without docs,
# man pages and locales); the tarball restores in about a second, so a second CI run is fast.
set -eu
out=${1:?usage: systemd-root.sh TARBALL}
if [ -s "$out" ]; then
  echo "$out"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "systemd-root.sh: mmdebstrap is not installed" >&2; exit 1; }
# The mirror apt uses (deb822 or one-line sources), else Debian's own.
mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -n 1)
[ -n "$mirror" ] || mirror=$(sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\) .*/\2/p' /etc/apt/sources.list 2>/dev/null | grep -v security | head -n 1)
[ -n "$mirror" ] || mirror=http://deb.debian.org/debian
mkdir -p "$(dirname "$out")"
tmp="$out.tmp.$$"
trap 'rm -rf "$tmp" "$tmp.tar.zst"' EXIT
mmdebstrap --variant=minbase --include=systemd,systemd-sysv,dbus,libpam-systemd,procps,libssl3 \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  bookworm "$tmp" "deb $mirror bookworm main" >&2
tar --zstd -C "$tmp" -cf "$tmp.tar.zst" .
mv "$tmp.tar.zst" "$out"
echo "$out"
