#!/usr/bin/env bash
# e2e/cluster.sh up|down|env|status [--state-dir DIR]: a Kubernetes control plane on loopback whose
# pods run as local processes. Thin wrapper over cluster.py (see e2e/README.md).
#   e2e/cluster.sh up && eval "$(e2e/cluster.sh env)" && kubectl get nodes
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/cluster.py" "$@"
