# shellcheck shell=bash
# What the benches that run a stack share (sourced by fanout/, offload/ and ingest/bench.sh):
# the binaries built, a nats-server of their own, `stagehand up --external-nats` on it (the
# recorder, validator, shared promoter, demoter, backup copier with the default policies), and
# each node agent's configuration. The caller sets REPO, PROFILE and WORK, and cleans up the
# PIDs these record (NATS_PID, UP_PID, AGENT_PIDS) on exit.

NATS_PID= UP_PID=
AGENT_PIDS=()

# Sets BIN to the folder of the `stagehand` and `stagehand-promoter` of $PROFILE, built.
build_bins() {
    case "$PROFILE" in
    dev) (cd "$REPO" && cargo build -q -p stagehand --bin stagehand -p stagehand-promoter --bin stagehand-promoter); BIN=$CARGO_TARGET_DIR/debug ;;
    release) (cd "$REPO" && cargo build -q --release -p stagehand --bin stagehand -p stagehand-promoter --bin stagehand-promoter); BIN=$CARGO_TARGET_DIR/release ;;
    *) echo "bench.sh: PROFILE is dev or release, not $PROFILE" >&2; exit 1 ;;
    esac
}

# Sets NATS_SERVER: $STAGEHAND_NATS_SERVER, the one `deploy/servers.sh install` put under
# .stagehand, or one on PATH.
find_nats_server() {
    NATS_SERVER=${STAGEHAND_NATS_SERVER:-$REPO/.stagehand/venv/bin/nats-server}
    [ -x "$NATS_SERVER" ] || NATS_SERVER=$(command -v nats-server) || {
        echo "bench.sh: no nats-server (set STAGEHAND_NATS_SERVER, e.g. from deploy/servers.sh env)" >&2
        exit 1
    }
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Starts a nats-server with JetStream on $1 (an address of this host) and `stagehand up` on it,
# its home $2; sets NATS_PORT, exports STAGEHAND_NATS_URL; returns once `up` says it is up.
start_stack() {
    local host=$1 home=$2 port
    port=$(free_port)
    NATS_PORT=$port
    find_nats_server
    mkdir -p "$WORK/nats"
    "$NATS_SERVER" -c "$REPO/deploy/nats/dev.conf" -js -a "$host" -p "$port" -m -1 -sd "$WORK/nats" \
        >"$WORK/nats.log" 2>&1 &
    NATS_PID=$!
    export STAGEHAND_NATS_URL=nats://$host:$port
    for _ in $(seq 200); do (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null && break; sleep 0.1; done
    env -u STAGEHAND_HOME RUST_LOG=warn "$BIN/stagehand" up --external-nats --home "$home" \
        --metrics "127.0.0.1:$(free_port)" >"$WORK/up.out" 2>"$WORK/up.err" &
    UP_PID=$!
    wait_up "$UP_PID"
}

# Waits until the `stagehand up` of pid $1 says it is up in $WORK/up.out; exits showing
# $WORK/up.err if it ends first, or after a minute.
wait_up() {
    for _ in $(seq 600); do
        grep -q "stagehand is up" "$WORK/up.out" 2>/dev/null && return 0
        kill -0 "$1" 2>/dev/null || { cat "$WORK/up.err" >&2; exit 1; }
        sleep 0.1
    done
    echo "bench.sh: stagehand up did not start" >&2
    exit 1
}

# Writes the configuration of node $1's agent into folder $2: the stack's policies (home $3)
# with the node's own local root `tiers/local-<node>`, and promoter.toml with its metrics on
# $4 (address:port); a fifth argument is appended to promoter.toml (its `[service.fanout]`).
write_agent_config() {
    local node=$1 dir=$2 home=$3 metrics=$4 extra=${5:-} f
    mkdir -p "$dir/policies" "$home/tiers/local-$node"
    for f in "$home"/policies/*; do
        sed "s|$home/tiers/local\"|$home/tiers/local-$node\"|" "$f" >"$dir/policies/$(basename "$f")"
    done
    cat >"$dir/promoter.toml" <<EOF
[bus]
servers = ["$STAGEHAND_NATS_URL"]
client_name = "promoter-$node"

[worker]
instance_id = "$node"

[telemetry]
log_level = "warn"
metrics_listen = "$metrics"

[service]
policies_dir = "$dir/policies"
state_dir = "$dir/state"
node = "$node"
$extra
EOF
}

# Waits until the service whose metrics are at $1 (address:port) answers /readyz, or exits
# showing the log $2.
wait_ready() {
    for _ in $(seq 600); do
        python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://$1/readyz', timeout=2).status != 200)" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "bench.sh: the agent at $1 is not ready:" >&2
    cat "$2" >&2
    exit 1
}

# Kills the agents (as a node dies) and waits for them.
stop_agents() {
    local pid
    for pid in "${AGENT_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    for pid in "${AGENT_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    AGENT_PIDS=()
}

# Stops the stack's processes (the agents first) and waits for them.
stop_stack() {
    stop_agents
    [ -n "$UP_PID" ] && { kill -INT "$UP_PID" 2>/dev/null || true; wait "$UP_PID" 2>/dev/null || true; }
    [ -n "$NATS_PID" ] && { kill "$NATS_PID" 2>/dev/null || true; wait "$NATS_PID" 2>/dev/null || true; }
    UP_PID= NATS_PID=
}
