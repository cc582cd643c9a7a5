#!/usr/bin/env bash
# Builds the pagedserve image with podman, from a base image made here (no
# image registry needed): minimal Debian root filesystems from debootstrap
# (build: python3.11, venv, headers, g++; CPU runtime: python3.11, g++),
# imported with `podman import` and cached.
#
#   scripts/build-image.sh                      # pagedserve:latest (CPU torch)
#   scripts/build-image.sh --bake-model         # + the converted SmolLM2 inside
#   scripts/build-image.sh --variant cuda       # CUDA torch (needs a CUDA torch wheel in reach)
#   scripts/build-image.sh --git-ref HEAD       # build a commit (git archive), not the working tree
#   scripts/build-image.sh --keep-cache         # keep the untagged build stages (layer cache)
#
# Environment: PAGEDSERVE_IMAGE (default pagedserve:latest), PAGEDSERVE_BASE_IMAGE
# (default localhost/pagedserve-base:bookworm), DEBIAN_SUITE (bookworm: its
# python3 is 3.11), DEBIAN_MIRROR, PODMAN (default podman). The local pip
# mirrors (`pip config list`: find-links, extra-index-url file://...) are mounted
# read-only into the build, so pip inside it installs the same wheels as here.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${PAGEDSERVE_IMAGE:-pagedserve:latest}"
BASE="${PAGEDSERVE_BASE_IMAGE:-localhost/pagedserve-base:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PODMAN="${PODMAN:-podman}"
VARIANT=cpu
BAKE=0
REBUILD_BASE=0
GIT_REF="${PAGEDSERVE_BUILD_REF:-}"
KEEP_CACHE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) VARIANT="$2"; shift 2 ;;
    --bake-model) BAKE=1; shift ;;
    --rebuild-base) REBUILD_BASE=1; shift ;;
    --git-ref) GIT_REF="$2"; shift 2 ;;
    --keep-cache) KEEP_CACHE=1; shift ;;
    --prune) KEEP_CACHE=0; shift ;;  # the default now; kept for old scripts
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "build-image.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

need=()
command -v "$PODMAN" >/dev/null || need+=(podman)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v runc >/dev/null || need+=(runc)
if [ ${#need[@]} -gt 0 ]; then
  echo "build-image.sh: installing ${need[*]} with apt-get" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi

# Debian's podman as root here: crun fails on setrlimit and hybrid cgroups, runc works.
RUNTIME=(--runtime runc)
ULIMITS=(--ulimit nofile=4096:4096 --ulimit nproc=4096:4096)

# ---------------------------------------------------------------- base images
# The build stage's base: minbase + python3.11 with venv and headers, g++, CA certificates.
# The CPU runtime's: python3 and g++ only (the CPU kernels are compiled at first start for the
# host's CPU, -march=native; no Python headers or venv module are needed to run).
make_base() {  # NAME PACKAGES
  local name="$1" packages="$2" root
  if [ "$REBUILD_BASE" != 1 ] && "$PODMAN" image exists "$name"; then
    echo "build-image.sh: base image $name exists (--rebuild-base to remake it)" >&2
    return
  fi
  root="$(mktemp -d /var/tmp/pagedserve-rootfs.XXXXXX)"
  trap 'rm -rf "$root"' EXIT
  echo "build-image.sh: debootstrap $SUITE ($packages) into $root (once; a few minutes)" >&2
  debootstrap --variant=minbase --include="$packages" "$SUITE" "$root" "$MIRROR"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/* \
    "$root"/usr/share/locale/* "$root"/var/log/*.log
  tar -C "$root" -c . | "$PODMAN" import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $SUITE ($packages)" - "$name"
  rm -rf "$root"
  trap - EXIT
}
make_base "$BASE" python3,python3-venv,python3-dev,g++,ca-certificates
if [ "$VARIANT" = cpu ]; then
  RUNTIME_BASE="${PAGEDSERVE_RUNTIME_BASE_IMAGE:-localhost/pagedserve-runtime:$SUITE}"
  make_base "$RUNTIME_BASE" python3,g++,ca-certificates
else
  RUNTIME_BASE="$BASE"  # Triton builds its CUDA launcher against Python.h at run time
fi

# ---------------------------------------------------------------- project image
# pip's local mirrors and CA bundle, as this machine's pip config names them
# (`pip config list`), mounted read-only: pip inside the build installs the same wheels.
mounts=()
pipconf="$(mktemp /tmp/pagedserve-pip.XXXXXX.conf)"
trap 'rm -f "$pipconf"' EXIT
pipval() { pip config list 2>/dev/null | sed -n "s/^global\.$1='\(.*\)'$/\1/p" | head -1; }
links="$(pipval find-links)"
index="$(pipval extra-index-url)"
cert="$(pipval cert)"
{
  echo "[global]"
  echo "disable-pip-version-check = true"
  [ -n "$links" ] && echo "find-links = $links"
  [ -n "$index" ] && echo "extra-index-url = $index"
  # A TLS-intercepting proxy's CA may be in this machine's bundle: for the build only.
  [ -n "$cert" ] && [ -f "$cert" ] && echo "cert = /etc/pagedserve-build-ca.crt"
  true
} > "$pipconf"
for d in $links $(echo "$index" | tr ' ' '\n' | sed -n 's#^file://##p'); do
  # a file:// simple index links to ../files: mount its parent
  case "$d" in */simple|*/simple/) d="$(dirname "$d")" ;; esac
  [ -d "$d" ] && mounts+=(--volume "$d:$d:ro")
done
mounts+=(--volume "$pipconf:/etc/pip.conf:ro")
[ -n "$cert" ] && [ -f "$cert" ] && mounts+=(--volume "$cert:/etc/pagedserve-build-ca.crt:ro")
# Proxy settings of this machine, if any (apt/pip inside the build).
for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  [ -n "${!v:-}" ] && mounts+=(--build-arg "$v=${!v}")
done

# The build context: the working tree, or a commit (others may be mid-edit in a shared tree).
CONTEXT=.
if [ -n "$GIT_REF" ]; then
  CONTEXT="$(mktemp -d /var/tmp/pagedserve-context.XXXXXX)"
  trap 'rm -f "$pipconf"; rm -rf "$CONTEXT"' EXIT
  git archive "$GIT_REF" | tar -x -C "$CONTEXT"
  echo "build-image.sh: context is $GIT_REF ($(git rev-parse --short "$GIT_REF"))" >&2
fi

echo "build-image.sh: building $IMAGE (variant $VARIANT, bake model $BAKE) from $BASE" >&2
start=$(date +%s)
"$PODMAN" build --format docker "${RUNTIME[@]}" "${ULIMITS[@]}" "${mounts[@]}" \
  --build-arg "BASE_IMAGE=$BASE" --build-arg "RUNTIME_BASE=$RUNTIME_BASE" --build-arg "VARIANT=$VARIANT" --build-arg "BAKE_MODEL=$BAKE" \
  -t "$IMAGE" -f "$CONTEXT/Dockerfile" "$CONTEXT"
end=$(date +%s)
size="$("$PODMAN" image inspect --format '{{.Size}}' "$IMAGE")"
echo "build-image.sh: built $IMAGE in $((end - start)) s, $((size / 1000000)) MB"
# The pinned tag the Kubernetes manifests name (deploy/k8s/: never :latest); push it with
#   podman tag localhost/pagedserve:$VERSION REGISTRY/pagedserve:$VERSION && podman push REGISTRY/pagedserve:$VERSION
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
suffix=""; if [ "$VARIANT" = cuda ]; then suffix="-cuda"; fi
if [ -n "$VERSION" ] && [ "${IMAGE%%:*}" = pagedserve ]; then
  "$PODMAN" tag "$IMAGE" "pagedserve:$VERSION$suffix"
  echo "build-image.sh: tagged pagedserve:$VERSION$suffix" >&2
fi
if [ "$KEEP_CACHE" = 0 ]; then
  # Each build leaves its stages as untagged images (the build stage alone is about 3 GB): remove
  # this project's (by the Dockerfile's label), not other dangling images. --keep-cache keeps them
  # as the next build's layer cache (a rebuild then takes about a minute, not three).
  n="$("$PODMAN" images -q --filter dangling=true --filter label=org.pagedserve.built-by=build-image.sh | sort -u | wc -l)"
  "$PODMAN" image prune -f --filter label=org.pagedserve.built-by=build-image.sh >/dev/null
  echo "build-image.sh: removed $n untagged build stages (--keep-cache keeps them)" >&2
fi
