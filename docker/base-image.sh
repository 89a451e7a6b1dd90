#!/usr/bin/env bash
# The base image every Tandem image starts from, built from Debian's packages alone (no registry
# is needed to pull from): debootstrap a bookworm minbase root filesystem with bookworm's own
# python3.11 (+ venv, ca-certificates), strip what a container never reads, and
# `docker import` it as $BASE_IMAGE. Run as root (debootstrap chroots); `make base-image` runs it.
#
#   BASE_IMAGE   the tag to import as          (default tandem-base:bookworm)
#   MIRROR       the Debian mirror             (default http://deb.debian.org/debian)
#   SECURITY_MIRROR                            (default http://deb.debian.org/debian-security)
#   CACHE_DIR    where the downloaded .debs and the image's ID are kept (default build/base)
#   REBUILD=1    build even when $BASE_IMAGE already exists
#
# The packages debootstrap fetched are kept in $CACHE_DIR/debootstrap-bookworm-*.tgz (--make-tarball), so a
# rebuild reads them from there instead of the mirror. The imported image's ID (the sha256 of its
# configuration: `docker import` has no registry digest until pushed) and its root filesystem's
# sha256 go to $CACHE_DIR/base-image.id (not reproducible byte for byte: debootstrap writes the
# time of the build into files, so two builds differ in ID, not in content).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-tandem-base:bookworm}
SUITE=bookworm
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CACHE_DIR=${CACHE_DIR:-build/base}
DOCKER=${DOCKER:-docker}
# bookworm's python3.11 and its venv module (python3-venv brings ensurepip's wheels) and the CA
# bundle for HTTPS (object stores, Hugging Face). No init: the services handle SIGTERM as PID 1.
INCLUDE=python3.11,python3-venv,ca-certificates

if [ "${REBUILD:-0}" != 1 ] && $DOCKER image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "base-image: $BASE_IMAGE exists ($($DOCKER image inspect --format '{{.Id}}' "$BASE_IMAGE")); REBUILD=1 builds it again"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "base-image: debootstrap needs root (it chroots into the new root filesystem)" >&2
  exit 1
fi
command -v debootstrap >/dev/null || { echo "base-image: debootstrap missing (apt-get install debootstrap)" >&2; exit 1; }

mkdir -p "$CACHE_DIR"
CACHE_DIR=$(cd "$CACHE_DIR" && pwd)
TARBALL=$CACHE_DIR/debootstrap-$SUITE-$(printf %s "$INCLUDE" | sha256sum | cut -c1-12).tgz  # per package list
ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/tandem-rootfs.XXXXXX")
trap 'rm -rf "$ROOTFS"' EXIT
start=$(date +%s)

if [ ! -s "$TARBALL" ]; then
  echo "base-image: downloading $SUITE's minbase packages + $INCLUDE from $MIRROR into $TARBALL"
  debootstrap --variant=minbase --include="$INCLUDE" --make-tarball="$TARBALL.tmp" "$SUITE" "$ROOTFS/unused" "$MIRROR"
  mv "$TARBALL.tmp" "$TARBALL"
fi
echo "base-image: debootstrap $SUITE minbase from $TARBALL"
debootstrap --variant=minbase --include="$INCLUDE" --unpack-tarball="$TARBALL" "$SUITE" "$ROOTFS/root" "$MIRROR"
R=$ROOTFS/root

case "$R" in /tmp/*/root|"${TMPDIR:-/tmp}"/*/root) ;; *) echo "base-image: unexpected root $R" >&2; exit 1;; esac
# debootstrap installs bookworm's point release; the -updates and -security suites bring it up to
# date (and are what the Redis image's apt-get reads). Then a container's view: no package caches,
# docs or locales, no machine identity (Docker mounts its own resolv.conf, hosts and hostname).
printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s %s-security main\n' \
  "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" "${SECURITY_MIRROR:-http://deb.debian.org/debian-security}" "$SUITE" \
  > "$R/etc/apt/sources.list"
rm -f "$R/etc/resolv.conf" && cp /etc/resolv.conf "$R/etc/resolv.conf"
chroot "$R" apt-get update -q
DEBIAN_FRONTEND=noninteractive chroot "$R" apt-get -y -q upgrade
chroot "$R" apt-get clean
rm -f "$R/etc/resolv.conf"
rm -rf "$R"/var/lib/apt/lists/* "$R"/var/cache/apt/*.bin "$R"/var/cache/debconf/*-old \
       "$R"/usr/share/doc/* "$R"/usr/share/man/* "$R"/usr/share/info/* "$R"/usr/share/locale/* \
       "$R"/var/log/* "$R"/tmp/* "$R"/root/.cache
: > "$R/etc/machine-id"
# Keep docs, man pages and locales out of what apt installs later (the Redis image).
cat > "$R/etc/dpkg/dpkg.cfg.d/01-container" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF

tar -C "$R" --numeric-owner -cf "$ROOTFS/rootfs.tar" .
rootfs_sha=$(sha256sum "$ROOTFS/rootfs.tar" | cut -d' ' -f1)
$DOCKER import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "tandem base: debootstrap --variant=minbase $SUITE + $INCLUDE" \
  "$ROOTFS/rootfs.tar" "$BASE_IMAGE" >/dev/null
id=$($DOCKER image inspect --format '{{.Id}}' "$BASE_IMAGE")
size=$($DOCKER image inspect --format '{{.Size}}' "$BASE_IMAGE")
{
  echo "image: $BASE_IMAGE"
  echo "id: $id"
  echo "rootfs_sha256: $rootfs_sha"
  echo "size_bytes: $size"
  echo "python: $(chroot "$R" python3.11 --version)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(( $(date +%s) - start )) s"
} > "$CACHE_DIR/base-image.id"
cat "$CACHE_DIR/base-image.id"
