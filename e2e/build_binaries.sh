#!/usr/bin/env bash
# Builds the e2e cluster's binaries from source (Go module proxy) and caches them in
#   ~/.cache/pagefleet/k8s/<version>/
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and etcd come from the
# module in e2e/gobuild (k8s.io/kubernetes + its staging modules pinned); helm comes from
# e2e/gobuild/helm, a separate module so helm's dependencies cannot move Kubernetes' pins.
# Only the first run pays for the build (10-30 min on 2 cores); later runs return at once.
# Prints the cache directory on the last line of stdout.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KUBE_VERSION="v1.34.4"   # keep in step with e2e/gobuild/go.mod
HELM_VERSION="v3.19.5"   # keep in step with e2e/gobuild/helm/go.mod
CACHE_ROOT="${PAGEFLEET_K8S_CACHE:-$HOME/.cache/pagefleet/k8s}"
DEST="$CACHE_ROOT/$KUBE_VERSION"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm)
# What the cached binaries were built from; a change here (a pin, the patch below) rebuilds them.
STAMP="kubernetes=$KUBE_VERSION etcd=v3.6.4 helm=$HELM_VERSION patch=endpoint-ip-loopback-1"

log() { echo "[build_binaries $(date +%H:%M:%S)] $*" >&2; }

have_all() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$DEST/$b" ]] || return 1; done
  [[ "$(cat "$DEST/BUILD_STAMP" 2>/dev/null)" == "$STAMP" ]]
}

if have_all; then
  log "cached binaries in $DEST"
  echo "$DEST"
  exit 0
fi

# PAGEFLEET_GO names a toolchain explicitly (and lets the no-Go message be tested).
GO="${PAGEFLEET_GO:-$(command -v go || true)}"
[[ -z "${PAGEFLEET_GO:-}" && -z "$GO" && -x /usr/local/go/bin/go ]] && GO=/usr/local/go/bin/go
if [[ -z "$GO" || ! -x "$GO" ]]; then
  cat >&2 <<'EOF'
ERROR: the e2e Kubernetes control plane is built from source and needs a Go toolchain (>= 1.24),
which was not found on PATH or at /usr/local/go/bin/go.
Install Go (https://go.dev/dl/, e.g. unpack go1.24+ into /usr/local/go) and re-run; or point
PAGEFLEET_E2E_KUBECONFIG at an existing cluster (with KUBECONFIG set) to skip the build.
EOF
  exit 3
fi

mkdir -p "$CACHE_ROOT"
# One builder at a time: a second caller waits here, then finds the cache filled.
exec 9>"$CACHE_ROOT/.build.lock"
if ! flock -n 9; then
  log "another build holds $CACHE_ROOT/.build.lock; waiting for it"
  flock 9
fi
if have_all; then
  log "cached binaries in $DEST (built by another process)"
  echo "$DEST"
  exit 0
fi

START=$SECONDS
STAGE="$CACHE_ROOT/.staging-$KUBE_VERSION-$$"
# The staging dir holds a hard-linked copy of a read-only module: make its directories writable
# (never chmod the files: they share inodes with the module cache) before removing it.
remove_tree() { [[ -e "$1" ]] || return 0; find "$1" -type d -exec chmod u+w {} +; rm -rf "$1"; }
remove_tree "$STAGE" && mkdir -p "$STAGE"
trap 'remove_tree "$STAGE"' EXIT
log "building Kubernetes $KUBE_VERSION, etcd and helm $HELM_VERSION with $("$GO" version) (first run only; 10-30 min on 2 cores)"

export CGO_ENABLED=0
export GOFLAGS="-buildvcs=false ${GOFLAGS:-}"
minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
# The same version stamps hack/lib/version.sh writes, for the server and the client side.
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

# Progress: `go build -v` names each package as it compiles; print a count every 100.
progress() {
  local n=0 line
  while IFS= read -r line; do
    n=$((n + 1))
    if (( n % 100 == 0 )); then log "  $1: $n packages compiled ($((SECONDS - START))s)"; fi
    # Package names go to the count; compiler diagnostics ("file.go:12:3: ...", "# pkg") to stderr.
    case "$line" in *".go:"[0-9]*|"# "*|"go: "*) echo "$line" >&2 ;; esac
  done
  log "  $1: $n packages compiled"
}

# The one change to Kubernetes: pods here are local processes on loopback addresses (127.0.0.x),
# and the apiserver refuses 127.0.0.0/8 in Endpoints/EndpointSlices (ValidateEndpointIP), so the
# EndpointSlice controller could never publish them. We build from a hard-linked copy of the pinned
# module in which only that loopback check is dropped (go refuses -overlay on the module cache);
# every other rule stays as released.
# `go list -m` names the module's folder only once it is in the module cache: a fresh machine has none.
(cd "$HERE/gobuild" && "$GO" mod download k8s.io/kubernetes) \
  || { log "could not download k8s.io/kubernetes (is the Go module proxy reachable?)"; exit 5; }
kube_src="$(cd "$HERE/gobuild" && "$GO" list -m -f '{{.Dir}}' k8s.io/kubernetes)"
[[ -d "$kube_src" ]] || { log "k8s.io/kubernetes is not in the module cache after go mod download"; exit 5; }
kube_copy="$STAGE/kubernetes"
cp -al "$kube_src" "$kube_copy"
validation_go="pkg/apis/core/validation/validation.go"
chmod u+w "$kube_copy" "$(dirname "$kube_copy/$validation_go")"
rm -f "$kube_copy/$validation_go"
awk '/^func ValidateEndpointIP\(/ {inside=1}
     inside && /if ip.IsLoopback\(\) \{/ {sub(/if ip.IsLoopback\(\) \{/, "if false \\&\\& ip.IsLoopback() { // pagefleet e2e: pod IPs are loopback"); patched++}
     inside && /^}/ {inside=0}
     {print}
     END {if (patched != 1) exit 1}' "$kube_src/$validation_go" > "$kube_copy/$validation_go" \
  || { log "could not patch ValidateEndpointIP in $kube_src/$validation_go (did the pin change?)"; exit 4; }
# A scratch copy of our module that points k8s.io/kubernetes at the patched copy.
mkdir -p "$STAGE/gobuild"
cp "$HERE/gobuild/go.mod" "$HERE/gobuild/go.sum" "$STAGE/gobuild/"
cd "$STAGE/gobuild"
"$GO" mod edit -replace "k8s.io/kubernetes=$kube_copy"

log "kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd (one go build, shared packages)"
set +e
"$GO" build -v -trimpath -tags selinux,notest -ldflags "$ldflags" -o "$STAGE/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl \
  go.etcd.io/etcd/server/v3 2>&1 | progress kubernetes
rc=${PIPESTATUS[0]}
set -e
(( rc == 0 )) || { log "go build of Kubernetes failed (rc=$rc)"; exit "$rc"; }
# etcd's main package is the module root go.etcd.io/etcd/server/v3, so go names it "server".
mv "$STAGE/server" "$STAGE/etcd"
remove_tree "$kube_copy"; remove_tree "$STAGE/gobuild"

cd "$HERE/gobuild/helm"
log "helm $HELM_VERSION"
set +e
"$GO" build -v -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
  -o "$STAGE/helm" helm.sh/helm/v3/cmd/helm 2>&1 | progress helm
rc=${PIPESTATUS[0]}
set -e
(( rc == 0 )) || { log "go build of helm failed (rc=$rc)"; exit "$rc"; }

echo "$STAMP" > "$STAGE/BUILD_STAMP"
# Publish atomically: a cache directory either holds every binary or does not exist.
rm -rf "$DEST"
mv "$STAGE" "$DEST"
trap - EXIT
log "built ${BINARIES[*]} into $DEST in $((SECONDS - START))s"
"$DEST/kube-apiserver" --version >&2 || true
echo "$DEST"
