#!/bin/sh
# Stagehand's init container: holds a pod until its dataset is on the tier it asks for, or fails
# the pod with Stagehand's reason.
#
#   stagehand stage request D@V --tier T --job <pod uid> [--node <node>]   (ids from the pod)
#   stagehand stage wait    D@V --tier T --job <pod uid> [--node <node>] --timeout ...
#
# Settings (environment; pod.yaml fills them from the pod's annotations and the downward API):
#   STAGEHAND_DATASET, STAGEHAND_VERSION, STAGEHAND_TIER   what to stage (required)
#   STAGEHAND_PROJECT                                      project (required)
#   STAGEHAND_JOB                                          the pod's uid (required)
#   STAGEHAND_NODE                                         the node, for a node-local tier
#   STAGEHAND_NAME                                         variable suffix; default the dataset
#                                                          upper-cased, other characters '_'
#   STAGEHAND_TIMEOUT                                      how long to wait (default 1h)
#   STAGEHAND_DEADLINE                                     the request's deadline (optional)
#   STAGEHAND_HOLD_UNTIL                                   how long the data is held at most if
#                                                          the stage is never released (a
#                                                          duration from the request, or an
#                                                          RFC 3339 time; optional: held until
#                                                          released)
#   STAGEHAND_ENV_FILE                                     where the path is written as
#                                                          STAGEHAND_DATA_<NAME>=<path>, for the
#                                                          app container (default
#                                                          /stagehand/env)
#   STAGEHAND_NATS_URL, STAGEHAND_NATS_PASSWORD_FILE,      how the CLI reaches NATS: the URL
#   STAGEHAND_NATS_TLS_CA (or _CREDS, _NKEY)               names the namespace's user, the
#                                                          password is in a file (the CLI reads
#                                                          these itself: none is on a command
#                                                          line)
#   STAGEHAND_BIN                                          the CLI (default: stagehand on PATH)
#   STAGEHAND_TERMINATION_LOG                              default /dev/termination-log
#
# Exit 0: ready, the env file written. Otherwise the reason is the last line on stderr and in the
# termination log, which `kubectl describe pod` shows as the init container's message; the exit
# code is the CLI's (1 failed, 2 timed out, 64 bad setting, 69 NATS unreachable).
set -u

bin="${STAGEHAND_BIN:-stagehand}"
env_file="${STAGEHAND_ENV_FILE:-/stagehand/env}"
termination_log="${STAGEHAND_TERMINATION_LOG:-/dev/termination-log}"

fail() {
    code="$1"
    shift
    echo "stagehand-stage-init: $*" >&2
    # Kubernetes shows this file's content as the container's termination message.
    printf 'stagehand: %s\n' "$*" >"$termination_log" 2>/dev/null || true
    exit "$code"
}

for v in STAGEHAND_DATASET STAGEHAND_VERSION STAGEHAND_TIER STAGEHAND_PROJECT STAGEHAND_JOB; do
    eval "value=\${$v:-}"
    [ -n "$value" ] || fail 64 "$v is not set (see the pod's stagehand.io/* annotations)"
done

target="$STAGEHAND_DATASET@$STAGEHAND_VERSION"
name="${STAGEHAND_NAME:-$(printf '%s' "$STAGEHAND_DATASET" | tr '[:lower:]' '[:upper:]' | tr -c 'A-Z0-9' '_')}"
set -- --tier "$STAGEHAND_TIER" --job "$STAGEHAND_JOB" --project "$STAGEHAND_PROJECT"
if [ -n "${STAGEHAND_NODE:-}" ]; then
    set -- "$@" --node "$STAGEHAND_NODE"
fi

# The request's own options, after the ones it shares with `stage wait` ("$@").
request() {
    if [ -n "${STAGEHAND_DEADLINE:-}" ]; then
        set -- "$@" --deadline "$STAGEHAND_DEADLINE"
    fi
    if [ -n "${STAGEHAND_HOLD_UNTIL:-}" ]; then
        set -- "$@" --hold-until "$STAGEHAND_HOLD_UNTIL"
    fi
    "$bin" stage request "$target" "$@" --by "pod/$STAGEHAND_JOB"
}
err="$(request "$@" 2>&1 >/dev/null)"
rc=$?
[ "$rc" -eq 0 ] || fail "$rc" "requesting $target on $STAGEHAND_TIER: $err"

out="$("$bin" stage wait "$target" "$@" --timeout "${STAGEHAND_TIMEOUT:-1h}")"
rc=$?
case "$rc" in
0) ;;
1) fail 1 "$target on $STAGEHAND_TIER failed: $out" ;;
2) fail 2 "$target on $STAGEHAND_TIER not ready after ${STAGEHAND_TIMEOUT:-1h}: $out" ;;
*) fail "$rc" "waiting for $target on $STAGEHAND_TIER: exit $rc" ;;
esac

mkdir -p "$(dirname "$env_file")" || fail 73 "cannot create $(dirname "$env_file")"
printf 'STAGEHAND_DATA_%s=%s\n' "$name" "$out" >>"$env_file" || fail 73 "cannot write $env_file"
echo "stagehand-stage-init: $target on $STAGEHAND_TIER ready at $out" >&2
