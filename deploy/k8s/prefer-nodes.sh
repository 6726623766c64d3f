#!/bin/sh
# Prints a JSON merge patch of a pod that makes the scheduler prefer the nodes holding a usable
# copy of a dataset version on a node-local tier (`stagehand stage where … --hostlist`): a
# preferredDuringSchedulingIgnoredDuringExecution node affinity on `kubernetes.io/hostname`.
# A preference, not a requirement: when those nodes are full the pod goes elsewhere and its
# init container stages the version there. When no node holds a usable copy it prints `{}`
# (nothing to merge) and exits 0.
#
#   prefer-nodes.sh DATASET@VERSION --project P [--tier local]
#   kubectl patch --local -f stage-pod.yaml --type merge -o yaml \
#       -p "$(prefer-nodes.sh imagenet-mini@5f2c9a0e11b34d7a --project lab)" | kubectl create -f -
#
# Runs where the pod is made (a submit host, a job controller), as a NATS user allowed catalogue
# queries (`scheduler` of deploy/nats/accounts.conf): the namespaces' own users are not.
# STAGEHAND_BIN names the CLI (default `stagehand` on PATH); the CLI's own settings
# (STAGEHAND_NATS_URL, STAGEHAND_NATS_PASSWORD_FILE, …) come from the environment.
# Exit codes: those of `stagehand stage where` other than 3 (64 bad arguments, 69 NATS or the
# catalogue unreachable, 70 anything else).
set -eu

if [ $# -lt 1 ]; then
    echo "usage: prefer-nodes.sh DATASET@VERSION --project P [--tier T]" >&2
    exit 64
fi

rc=0
held=$("${STAGEHAND_BIN:-stagehand}" stage where "$@" --hostlist) || rc=$?
case $rc in
    0) ;;
    3) echo '{}'; exit 0 ;;
    *) exit "$rc" ;;
esac

# Each name a JSON string (a node name a stage accepts is [A-Za-z0-9_-]; escaped regardless).
values=$(printf '%s' "$held" | sed 's/[\\"]/\\&/g; s/^/"/; s/,/","/g; s/$/"/')
printf '{"spec":{"affinity":{"nodeAffinity":{"preferredDuringSchedulingIgnoredDuringExecution":[{"weight":100,"preference":{"matchExpressions":[{"key":"kubernetes.io/hostname","operator":"In","values":[%s]}]}}]}}}}\n' "$values"
