#!/usr/bin/env bash
# The Python producer test: raw ingest requests published from Python (nats-py + msgpack,
# following schemas/) are handled by the real services exactly as ones from Rust — a small
# manifest inline, and a large one by reference (put into the project's upload bucket with
# nats-py's Object Store), validated and catalogued with every file.
#
#   deploy/py-tests.sh
#
# It builds the service binaries with cargo, starts a private nats-server with JetStream on a
# free port (or uses PY_TESTS_NATS_URL when set), writes policies whose posix source tier lives
# in a temp folder, starts the services (the ingest validator, the catalogue recorder and the
# resharder), and
# runs schemas/examples/python/test_ingest_roundtrip.py with the checks of deploy/py-checks/
# (the catalogue lists the validated version and the rejection), then
# schemas/examples/python/test_checkpoint_commit.py (a DCP save committed with the `stagehand`
# binary; torch is not installed, the test writes DCP's layout without it). Its last line on
# stdout is "N passed, M failed" over both; the exit status is non-zero when anything failed,
# set-up included.
# Everything it started is stopped, and its temp folder removed, on exit.
#
# Settings (environment): PY_TESTS_NATS_URL (use this server instead of starting one),
# STAGEHAND_NATS_SERVER (nats-server binary; default from PATH), PYTHON (default: the venv of
# deploy/servers.sh when present, else python3), CARGO_TARGET_DIR, PY_TEST_TIMEOUT (seconds a
# test waits for a fact; default 60).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
TARGET="${CARGO_TARGET_DIR:-$REPO/target}"
STAGEHAND_HOME="${STAGEHAND_HOME:-$REPO/.stagehand}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$STAGEHAND_HOME/venv/bin/python" ]; then PYTHON="$STAGEHAND_HOME/venv/bin/python"; else PYTHON=python3; fi
fi
NATS_SERVER="${STAGEHAND_NATS_SERVER:-nats-server}"
[ -x "$STAGEHAND_HOME/venv/bin/nats-server" ] && [ -z "${STAGEHAND_NATS_SERVER:-}" ] && NATS_SERVER="$STAGEHAND_HOME/venv/bin/nats-server"

log() { printf 'py-tests.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/stagehand-py-tests.XXXXXX")"
PIDS=()
SUMMARY_PRINTED=0
cleanup() {
    local status=$?
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    if [ "$status" -ne 0 ]; then
        for logfile in "$WORK"/*.log; do
            [ -f "$logfile" ] || continue
            log "--- last lines of $(basename "$logfile") ---"
            tail -n 40 "$logfile" >&2 || true
        done
    fi
    rm -rf "$WORK"
    # A failure before the tests ran still ends with the summary line, counted as one failure.
    if [ "$SUMMARY_PRINTED" -eq 0 ]; then
        [ "$status" -ne 0 ] || status=1
        echo "0 passed, 1 failed"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$PYTHON" -c 'import nats, msgpack, webdataset' 2>/dev/null ||
    die "$PYTHON lacks nats-py, msgpack or webdataset; run deploy/servers.sh install (or pip install -r deploy/requirements.txt)"

# --- build -----------------------------------------------------------------------------------
# Services the test runs; a later service adds its package here and a start_service line below.
PACKAGES=(stagehand-ingest-validator stagehand-catalogue-recorder stagehand-resharder)
log "building ${PACKAGES[*]}"
cargo build --quiet $(printf -- '-p %s ' "${PACKAGES[@]}")
# The CLI, for the checkpoint commit test.
cargo build --quiet -p stagehand --bin stagehand

# --- nats-server -----------------------------------------------------------------------------
free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

if [ -n "${PY_TESTS_NATS_URL:-}" ]; then
    NATS_URL="$PY_TESTS_NATS_URL"
    log "using nats-server at $NATS_URL"
else
    command -v "$NATS_SERVER" >/dev/null || die "nats-server not found; run deploy/servers.sh install"
    port="$(free_port)"
    mkdir -p "$WORK/nats"
    "$NATS_SERVER" -js -a 127.0.0.1 -p "$port" -sd "$WORK/nats" >"$WORK/nats-server.log" 2>&1 &
    PIDS+=("$!")
    NATS_URL="nats://127.0.0.1:$port"
    # Ready when it accepts a connection and JetStream answers.
    "$PYTHON" - "$NATS_URL" <<'PY' || die "nats-server did not become ready"
import asyncio, sys, time
import nats

async def main(url):
    deadline = time.monotonic() + 30
    while True:
        try:
            nc = await nats.connect(url, connect_timeout=1, max_reconnect_attempts=0, allow_reconnect=False)
            await nc.jetstream().account_info()
            await nc.close()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)

asyncio.run(main(sys.argv[1]))
PY
    log "nats-server on $NATS_URL"
fi

# --- policies and tiers ----------------------------------------------------------------------
# The shipped policies, with every posix tier under this run's folder.
export STAGEHAND_HOME="$WORK/home"
TIER_ROOT="$STAGEHAND_HOME/tiers/source"
PREPARED_ROOT="$STAGEHAND_HOME/tiers/capacity"
HOT_ROOT="$STAGEHAND_HOME/tiers/hot"
mkdir -p "$TIER_ROOT" "$PREPARED_ROOT" "$HOT_ROOT" "$WORK/state"
cp -r "$REPO/policies" "$WORK/policies"
# The resharder packs the dataset of deploy/py-checks/resharder_webdataset.py (few files, so
# named here; the shipped thresholds select none of the test's datasets).
cat >>"$WORK/policies/packing.toml" <<TOML

[datasets."lab-py/py-shards"]
pack = true
seed = 20261129
shard_size = "1 MiB"
require_extensions = ["cls", "jpg"]
TOML

# --- services --------------------------------------------------------------------------------
start_service() {
    local name="$1"
    shift
    # The configuration file names the server: no STAGEHAND_NATS_* from the caller's shell.
    env -u STAGEHAND_NATS_URL -u STAGEHAND_NATS_CREDS -u STAGEHAND_NATS_NKEY \
        "$TARGET/debug/$name" "$@" >"$WORK/$name.log" 2>&1 &
    PIDS+=("$!")
    log "started $name (pid $!)"
}

# Each service reads a configuration file of the shape deploy/config/ ships.
cat >"$WORK/ingest-validator.toml" <<TOML
[bus]
servers = ["$NATS_URL"]
[service]
policies_dir = "$WORK/policies"
state_dir = "$WORK/state/ingest-validator"
TOML
cat >"$WORK/catalogue-recorder.toml" <<TOML
[bus]
servers = ["$NATS_URL"]
[service]
instance = "py-tests"
store_path = "$WORK/state/catalogue-recorder/catalogue.redb"
ledger_dir = "$WORK/state/catalogue-recorder/ledger"
TOML
cat >"$WORK/resharder.toml" <<TOML
[bus]
servers = ["$NATS_URL"]
[service]
policies_dir = "$WORK/policies"
state_dir = "$WORK/state/resharder"
TOML
start_service stagehand-ingest-validator --config "$WORK/ingest-validator.toml"
start_service stagehand-catalogue-recorder --config "$WORK/catalogue-recorder.toml"
start_service stagehand-resharder --config "$WORK/resharder.toml"

# --- the test --------------------------------------------------------------------------------
mkdir -p "$WORK/scratch"
service_pids="${PIDS[*]}"
# The harness prints the summary line itself, also when a test fails.
SUMMARY_PRINTED=1
status=0
PY_TEST_NATS_URL="$NATS_URL" \
    PY_TEST_TIER_ROOT="$TIER_ROOT" \
    PY_TEST_PREPARED_ROOT="$PREPARED_ROOT" \
    PY_TEST_WORK="$WORK/scratch" \
    PY_TEST_CHECKS_DIR="$REPO/deploy/py-checks" \
    PY_TEST_PIDS="$service_pids" \
    "$PYTHON" "$REPO/schemas/examples/python/test_ingest_roundtrip.py" | tee "$WORK/ingest.out" || status=1
PY_TEST_NATS_URL="$NATS_URL" \
    PY_TEST_STAGEHAND="$TARGET/debug/stagehand" \
    PY_TEST_POLICIES="$WORK/policies" \
    PY_TEST_HOT_ROOT="$HOT_ROOT" \
    PY_TEST_PIDS="$service_pids" \
    "$PYTHON" "$REPO/schemas/examples/python/test_checkpoint_commit.py" | tee "$WORK/checkpoint.out" || status=1
# One summary over both: each script's last line is "N passed, M failed".
tail -qn1 "$WORK/ingest.out" "$WORK/checkpoint.out" |
    awk '{ p += $1; f += $3 } END { printf "%d passed, %d failed\n", p, f }'
exit "$status"
