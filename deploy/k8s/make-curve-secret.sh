#!/usr/bin/env bash
# Prints a Kubernetes Secret `pagedserve-curve-keys` with a fresh CurveZMQ server keypair
# (`pagedserve keygen`), for deploy/k8s/pagedserve.yaml:
#   deploy/k8s/make-curve-secret.sh | kubectl apply -f -
#   deploy/k8s/make-curve-secret.sh > /tmp/keys.yaml && podman kube play /tmp/keys.yaml
# Never commit its output. Uses `pagedserve` from PATH, the project's .venv, or the image
# (PAGEDSERVE_IMAGE, default localhost/pagedserve:latest, run with podman).
set -euo pipefail
NAME="${1:-pagedserve-curve-keys}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
here="$(cd "$(dirname "$0")/../.." && pwd)"
if command -v pagedserve >/dev/null; then
  pagedserve keygen "$dir/k" >/dev/null
elif [ -x "$here/.venv/bin/pagedserve" ]; then
  "$here/.venv/bin/pagedserve" keygen "$dir/k" >/dev/null
else
  mkdir -p "$dir/k" && chmod 777 "$dir/k"
  podman run --rm -v "$dir/k:/out" --entrypoint /bin/sh "${PAGEDSERVE_IMAGE:-localhost/pagedserve:latest}" \
    -c 'pagedserve keygen /tmp/k >/dev/null && cp /tmp/k/* /out/'
fi
indent() { sed 's/^/    /'; }
cat <<YAML
apiVersion: v1
kind: Secret
metadata:
  name: $NAME
  labels: {app.kubernetes.io/name: pagedserve}
type: Opaque
stringData:
  server.key: |
$(indent < "$dir/k/server.key")
  server.key_secret: |
$(indent < "$dir/k/server.key_secret")
YAML
