#!/usr/bin/env bash
# Stagehand's node-local staging for Slurm: one script for slurm.conf's Prolog, TaskProlog and
# Epilog (it tells them apart by SLURM_SCRIPT_CONTEXT, or by its first argument).
#
#   Prolog (root, on each allocated node, with PrologFlags=Alloc before the job starts there):
#     for each `#BB_LUA stage ... tier=T` line of the job whose T is in STAGEHAND_LOCAL_TIERS,
#     `stagehand stage request D@V --tier T --job J --node $SLURMD_NODENAME`, then
#     `stagehand stage wait ...` bounded by STAGEHAND_PROLOG_TIMEOUT; records
#     `export STAGEHAND_DATA_<NAME>=<path>` for the TaskProlog. The promoter agent of this node
#     copies the version from the hot tier (where burst_buffer.lua's data_in staged it).
#     A failure exits 1 with Stagehand's reason on stderr: Slurm requeues the job held and
#     drains the node with "Prolog error" (a site may prefer that; the reason is in slurmd's
#     log and the job's AdminComment).
#   TaskProlog (the job's user, before each task): prints the recorded export lines, which
#     slurmstepd adds to the task's environment.
#   Epilog (root, after the job on each node): `stagehand stage release` for each node-local
#     stage, then removes the record.
#
# The directives come from `scontrol show job` (BurstBuffer=, the job's #BB_LUA lines), already
# checked at submit by burst_buffer.lua. Settings: stagehand-slurm.conf beside this script (or
# $STAGEHAND_SLURM_CONF). Every step is idempotent: ids are derived from the job, so a re-run
# Prolog asks the same request.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONF="${STAGEHAND_SLURM_CONF:-$HERE/stagehand-slurm.conf}"
export PATH="${PATH:-}:/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"

STAGEHAND_BIN=stagehand
STAGEHAND_NATS_URL=nats://127.0.0.1:4222
STAGEHAND_NATS_CREDS=
STAGEHAND_NATS_NKEY=
STAGEHAND_NATS_PASSWORD_FILE=
STAGEHAND_NATS_TLS_CA=
STAGEHAND_PROJECT=
STAGEHAND_JOB_PREFIX=slurm-
STAGEHAND_STATE_DIR=/run/stagehand-slurm
STAGEHAND_CONNECT_TIMEOUT=10
STAGEHAND_PROLOG_TIMEOUT=600
STAGEHAND_LOCAL_TIERS=local
if [ -r "$CONF" ]; then
    # KEY=VALUE lines only: read them as data, never run them.
    while IFS='=' read -r key value; do
        case "$key" in
        STAGEHAND_[A-Z_]*) printf -v "$key" '%s' "$value" ;;
        esac
    done < <(grep -E '^[A-Z_][A-Z0-9_]*=' "$CONF")
fi
# The cluster's slurm.conf, when it sits beside this script (deploy/slurm/slurm.sh's layout).
if [ -z "${SLURM_CONF:-}" ] && [ -r "$HERE/slurm.conf" ]; then
    export SLURM_CONF="$HERE/slurm.conf"
fi

job="${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run by slurmd as Prolog, TaskProlog or Epilog}"
record="$STAGEHAND_STATE_DIR/$job.node.env"
run_record="$STAGEHAND_STATE_DIR/$job.node.run"

say() { printf 'stagehand-node: job %s: %s\n' "$job" "$*" >&2; }

# Why the settings would put a NATS secret where other users see it, or nothing: a password in
# STAGEHAND_NATS_URL (it would be on the CLI's command line, in /proc/<pid>/cmdline), or a
# credentials file group or others may read. As burst_buffer.lua's credentials_problem.
credentials_problem() {
    local authority key path mode
    for authority in $(printf '%s' "$STAGEHAND_NATS_URL" | tr ',' ' '); do
        authority="${authority#*://}"
        authority="${authority%%/*}"
        case "$authority" in
        *:*@*)
            echo "STAGEHAND_NATS_URL in $CONF carries a password, which would be on every command line the hooks run: name only the user (nats://<user>@host:4222) and put the password in a root-only file named by STAGEHAND_NATS_PASSWORD_FILE"
            return
            ;;
        esac
    done
    for key in STAGEHAND_NATS_CREDS STAGEHAND_NATS_NKEY STAGEHAND_NATS_PASSWORD_FILE; do
        path="${!key}"
        [ -n "$path" ] || continue
        if ! mode="$(stat -L -c '%a' -- "$path" 2>&1)"; then
            echo "$key $path: $mode"
            return
        fi
        case "$mode" in
        *00) ;;
        *)
            echo "$key $path has mode $mode: group and others may read it (make it 0400 or 0600, owned by the user the hooks run as)"
            return
            ;;
        esac
    done
}

# The CLI with the connection of the settings: credentials named by path only, so its command
# line holds no secret.
stagehand() {
    local extra=() problem
    problem="$(credentials_problem)"
    if [ -n "$problem" ]; then
        echo "$problem" >&2
        return 64
    fi
    [ -z "$STAGEHAND_NATS_CREDS" ] || extra+=(--creds "$STAGEHAND_NATS_CREDS")
    [ -z "$STAGEHAND_NATS_NKEY" ] || extra+=(--nkey "$STAGEHAND_NATS_NKEY")
    [ -z "$STAGEHAND_NATS_PASSWORD_FILE" ] || extra+=(--password-file "$STAGEHAND_NATS_PASSWORD_FILE")
    [ -z "$STAGEHAND_NATS_TLS_CA" ] || extra+=(--tls-ca "$STAGEHAND_NATS_TLS_CA")
    "$STAGEHAND_BIN" --nats "$STAGEHAND_NATS_URL" --connect-timeout "$STAGEHAND_CONNECT_TIMEOUT" \
        ${extra[@]+"${extra[@]}"} "$@"
}

is_local_tier() {
    local t
    for t in ${STAGEHAND_LOCAL_TIERS//,/ }; do
        [ "$t" = "$1" ] && return 0
    done
    return 1
}

# The job id Stagehand sees for this run of the job: as burst_buffer.lua's run_of, the prefix
# and Slurm's id, and ".rN" once Slurm requeued the job N times (a requeued job stages afresh).
current_run() {
    local restarts
    restarts="$(scontrol -o show job "$job" 2>/dev/null | sed -n 's/.*[[:space:]]Restarts=\([0-9]*\).*/\1/p')"
    if [ -n "$restarts" ] && [ "$restarts" -gt 0 ]; then
        echo "$STAGEHAND_JOB_PREFIX$job.r$restarts"
    else
        echo "$STAGEHAND_JOB_PREFIX$job"
    fi
}

# Prints one line per node-local directive: "dataset version tier project name".
local_directives() {
    local line word key value dataset version tier project name
    scontrol show job "$job" 2>/dev/null | sed -n 's/^ *BurstBuffer=//; /^#BB_LUA/p' |
        while read -r line; do
            dataset="" version="" tier="" project="$STAGEHAND_PROJECT" name=""
            for word in ${line#\#BB_LUA}; do
                key="${word%%=*}"
                value="${word#*=}"
                case "$key" in
                dataset) dataset="$value" ;;
                version) version="$value" ;;
                tier) tier="$value" ;;
                project) project="$value" ;;
                name) name="$value" ;;
                esac
            done
            [ -n "$dataset" ] && is_local_tier "$tier" || continue
            if [ -z "$name" ]; then
                name="$(printf '%s' "$dataset" | tr '[:lower:]' '[:upper:]' | tr -c 'A-Z0-9' '_')"
            fi
            printf '%s %s %s %s %s\n' "$dataset" "$version" "$tier" "$project" "$name"
        done
}

prolog() {
    local node="${SLURMD_NODENAME:?SLURMD_NODENAME is not set}" directives lines=() out rc
    directives="$(local_directives)"
    [ -n "$directives" ] || return 0
    mkdir -p "$STAGEHAND_STATE_DIR"
    local run
    run="$(current_run)"
    # The Epilog releases exactly what this run asked for.
    printf '%s\n' "$run" >"$run_record.tmp" && mv -f "$run_record.tmp" "$run_record"
    while read -r dataset version tier project name; do
        set -- "$dataset@$version" --tier "$tier" --job "$run" \
            --node "$node" --project "$project"
        if ! out="$(stagehand stage request "$@" --by "slurm-prolog" 2>&1 >/dev/null)"; then
            fail "requesting $dataset@$version on $tier for node $node: $out"
            return 1
        fi
        out="$(stagehand stage wait "$@" --timeout "$STAGEHAND_PROLOG_TIMEOUT")"
        rc=$?
        case "$rc" in
        0) lines+=("export STAGEHAND_DATA_$name=$out") ;;
        1)
            fail "$dataset@$version on $tier for node $node failed: $out"
            return 1
            ;;
        2)
            fail "$dataset@$version on $tier for node $node not ready after ${STAGEHAND_PROLOG_TIMEOUT}s: $out"
            return 1
            ;;
        *)
            fail "waiting for $dataset@$version on $tier for node $node: exit $rc"
            return 1
            ;;
        esac
    done <<<"$directives"
    printf '%s\n' "${lines[@]}" >"$record.tmp" && chmod 0644 "$record.tmp" && mv -f "$record.tmp" "$record"
}

# Says why on stderr (slurmd's log) and in the job's AdminComment, which scontrol show job shows.
fail() {
    say "$*"
    scontrol update JobId="$job" AdminComment="stagehand: $*" >/dev/null 2>&1 || true
}

task_prolog() {
    [ -r "$record" ] && cat "$record"
    return 0
}

epilog() {
    local node="${SLURMD_NODENAME:?SLURMD_NODENAME is not set}" directives status=0 out run
    directives="$(local_directives)"
    if [ -n "$directives" ]; then
        run="$(cat "$run_record" 2>/dev/null || current_run)"
        while read -r dataset version tier project name; do
            if ! out="$(stagehand stage release "$dataset@$version" --tier "$tier" \
                --job "$run" --node "$node" --project "$project" 2>&1 >/dev/null)"; then
                say "releasing $dataset@$version on $tier for node $node: $out"
                status=1
            fi
        done <<<"$directives"
    fi
    rm -f "$record" "$run_record"
    return "$status"
}

case "${SLURM_SCRIPT_CONTEXT:-${1:-}}" in
prolog_slurmd | prolog) prolog ;;
prolog_task | task-prolog) task_prolog ;;
epilog_slurmd | epilog) epilog ;;
*)
    say "unknown context '${SLURM_SCRIPT_CONTEXT:-${1:-}}' (expected prolog_slurmd, prolog_task or epilog_slurmd)"
    exit 64
    ;;
esac
