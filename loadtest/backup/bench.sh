#!/usr/bin/env bash
# Backup benchmark: the backup copier backing a validated dataset up to an S3 backup tier
# (a local SeaweedFS), next to `rclone copy --checksum` of the same files to the same server,
# in the same run; then a restore drill of a 1 GiB sample of that backup.
#
#   loadtest/backup/bench.sh
#
# Settings (environment): BENCH_FILES files of BENCH_FILE_MIB MiB (default 32 x 64 MiB = 2 GiB;
# the issue's 20 GiB is BENCH_FILES=320, about 42 GB of free disk at the peak), BENCH_JOBS
# requests in flight (default 8), BENCH_PART_MIB part size (default 16), BENCH_ROUNDS (default
# 2), BENCH_DRILL_GIB (default 1), BENCH_DIR (scratch space, default a temp dir, removed at the
# end), PROFILE (bench-release).
#
# Per round, in alternating order: the copier with `verify = "read-back"` (the shipped policy:
# every object read back and hashed before the completion marker), the copier with
# `verify = "hashed-in-flight"` (the server checks each part's SHA-256), and rclone. Each run
# gets a fresh SeaweedFS (started, then stopped and its data removed, so the disk holds one copy
# at a time) and, for the copier, a fresh process and dataset name. The copier's time is from
# the `dataset.validated` publish to its `backup.completed` (the manifest, hashing the source,
# is the validator's work and timed apart). The drill is `Copier::drill` on the read-back backup:
# manifest restored and checked against the digest, the sample restored to local disk and every
# byte hashed, the fact published.
#
# Equal concurrency, as loadtest/mover/s3-bench.sh defines it: rclone --transfers J --checkers J
# --s3-upload-concurrency J --s3-chunk-size P --s3-upload-cutoff P, and the S3 tier's
# `concurrency = J` (requests in flight), `part_size = P`.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FILES="${BENCH_FILES:-32}"
FILE_MIB="${BENCH_FILE_MIB:-64}"
JOBS="${BENCH_JOBS:-8}"
PART_MIB="${BENCH_PART_MIB:-16}"
ROUNDS="${BENCH_ROUNDS:-2}"
DRILL_GIB="${BENCH_DRILL_GIB:-1}"
WORK="${BENCH_DIR:-$(mktemp -d /tmp/stagehand-backup-bench.XXXXXX)}"
mkdir -p "$WORK"
log() { printf 'backup-bench: %s\n' "$*" >&2; }

command -v rclone >/dev/null || { log "rclone is missing: deploy/servers.sh install --bench"; exit 1; }
# Servers already named in the environment are used as they are (a worktree has no venv).
[ -n "${STAGEHAND_NATS_SERVER:-}" ] && [ -n "${STAGEHAND_WEED:-}" ] || eval "$("$REPO/deploy/servers.sh" env)"
: "${STAGEHAND_NATS_SERVER:?deploy/servers.sh install first}" "${STAGEHAND_WEED:?deploy/servers.sh install first}"
# The run's own NATS is named in each configuration; the environment's would override it.
unset STAGEHAND_NATS_URL
ACCESS_KEY=bench SECRET_KEY=bench-secret

PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ -n "${BENCH_DIR:-}" ] || rm -rf "$WORK"
}
trap cleanup EXIT

free_ports() { python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
wait_port() { for _ in $(seq 600); do python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1",int(sys.argv[1])),1)' "$1" 2>/dev/null && return 0; sleep 0.1; done; log "port $1 never opened"; return 1; }

# --- the binaries -------------------------------------------------------------------------------
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"
# PROFILE: the cargo profile the copier is timed with (bench-release by default; `release` to
# share another benchmark's build).
PROFILE=${PROFILE:-bench-release}
(cd "$REPO" && cargo build -q --profile "$PROFILE" -p stagehand-backup-copier -p stagehand-loadtest \
    --bin stagehand-backup-copier --bin backup-bench)
COPIER="$CARGO_TARGET_DIR/$PROFILE/stagehand-backup-copier"
DRIVER="$CARGO_TARGET_DIR/$PROFILE/backup-bench"

# --- NATS, for the whole run ----------------------------------------------------------------------
read -r NATS_PORT < <(free_ports 1)
"$STAGEHAND_NATS_SERVER" -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$WORK/nats" >"$WORK/nats.log" 2>&1 &
PIDS+=($!)
wait_port "$NATS_PORT" || { tail -20 "$WORK/nats.log" >&2; exit 1; }
NATS="nats://127.0.0.1:$NATS_PORT"

# --- SeaweedFS, fresh for each run ----------------------------------------------------------------
WEED_PID=""
S3_PORT=""
start_weed() {
    rm -rf "$WORK/weed" && mkdir -p "$WORK/weed/data"
    printf '{"identities":[{"name":"bench","credentials":[{"accessKey":"%s","secretKey":"%s"}],"actions":["Admin","Read","Write","List","Tagging"]}]}' \
        "$ACCESS_KEY" "$SECRET_KEY" >"$WORK/weed/s3.json"
    # Every port a free one: weed's default for the admin gRPC port (its HTTP port + 10000)
    # can be past 65535 or taken.
    local p; read -r -a p < <(free_ports 10)
    S3_PORT="${p[6]}"
    "$STAGEHAND_WEED" mini -dir="$WORK/weed/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.telemetry=false \
        -master.port="${p[0]}" -master.port.grpc="${p[1]}" -volume.port="${p[2]}" -volume.port.grpc="${p[3]}" \
        -filer.port="${p[4]}" -filer.port.grpc="${p[5]}" -s3.port="$S3_PORT" -s3.port.grpc="${p[7]}" \
        -s3.port.iceberg=0 -s3.port.lance=0 -webdav=false -admin.ui=false -admin.port="${p[8]}" \
        -admin.port.grpc="${p[9]}" -s3.config="$WORK/weed/s3.json" \
        -s3.localSocket="$WORK/weed/s3.sock" -filer.localSocket="$WORK/weed/filer.sock" >"$WORK/weed/weed.log" 2>&1 &
    WEED_PID=$!
    PIDS+=("$WEED_PID")
    wait_port "$S3_PORT" || { tail -20 "$WORK/weed/weed.log" >&2; exit 1; }
    for _ in $(seq 100); do rclone_env rclone --config /dev/null lsd bench: >/dev/null 2>&1 && break; sleep 0.2; done
    rclone_env rclone --config /dev/null mkdir bench:backup
}
stop_weed() { kill "$WEED_PID"; wait "$WEED_PID" 2>/dev/null || true; rm -rf "$WORK/weed"; }

# rclone: an S3 remote from the environment only; AWS_CA_BUNDLE breaks rclone 1.60's S3 client.
rclone_env() {
    env -u AWS_CA_BUNDLE \
        RCLONE_CONFIG_BENCH_TYPE=s3 RCLONE_CONFIG_BENCH_PROVIDER=Other RCLONE_CONFIG_BENCH_ENV_AUTH=false \
        RCLONE_CONFIG_BENCH_ACCESS_KEY_ID="$ACCESS_KEY" RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY="$SECRET_KEY" \
        RCLONE_CONFIG_BENCH_ENDPOINT="http://127.0.0.1:$S3_PORT" RCLONE_CONFIG_BENCH_REGION=us-east-1 \
        RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE=true "$@"
}

# --- data -----------------------------------------------------------------------------------------
SRC="$WORK/source"
log "making $FILES x $FILE_MIB MiB in $SRC/bench/data"
mkdir -p "$SRC/bench/data"
for i in $(seq -w 1 "$FILES"); do
    mkdir -p "$SRC/bench/data/d$((10#$i % 4))"
    head -c $((FILE_MIB * 1024 * 1024)) /dev/urandom >"$SRC/bench/data/d$((10#$i % 4))/f$i.bin"
done
BYTES=$((FILES * FILE_MIB * 1024 * 1024))
cat "$SRC"/bench/data/*/* >/dev/null # both tools read from the page cache

policies() { # dir verify
    mkdir -p "$1"
    cat >"$1/tiers.toml" <<TOML
[tiers.source]
kind = "posix"
role = "source"
failure_domain = "lab"
root = "$SRC"

[tiers.backup]
kind = "s3"
role = "backup"
failure_domain = "backup-site"
endpoint = "http://127.0.0.1:$S3_PORT"
allow_plaintext = true
bucket = "backup"
prefix = "stagehand"
concurrency = $JOBS
part_size = "$PART_MIB MiB"
TOML
    cp "$REPO/policies/validation.toml" "$1/validation.toml"
    sed -i 's/^max_file_size = .*/max_file_size = "64 GiB"/' "$1/validation.toml"
    cat >"$1/backup.toml" <<TOML
target = "backup"
select = ["dataset.validated"]
projects = []
checkpoint_tags = []
verify = "$2"
drill_every = "1000d"
drill_sample_files = 100000
drill_sample_bytes = "$DRILL_GIB GiB"
TOML
}

RESULTS="$WORK/results.tsv"
: >"$RESULTS"
now() { date +%s.%N; }

run_copier() { # round verify
    local r="$1" verify="$2" dir="$WORK/copier-$1-$2"
    start_weed
    policies "$dir/policies" "$verify"
    cat >"$dir/copier.toml" <<TOML
[bus]
servers = "$NATS"
[worker]
ack_wait = "60s"
[service]
policies_dir = "$dir/policies"
state_dir = "$dir/state"
drill_check = "1h"
TOML
    AWS_ACCESS_KEY_ID="$ACCESS_KEY" AWS_SECRET_ACCESS_KEY="$SECRET_KEY" RUST_LOG=warn \
        "$COPIER" --config "$dir/copier.toml" 2>"$dir/copier.log" &
    local copier=$!
    PIDS+=("$copier")
    sync
    local line
    line=$(AWS_ACCESS_KEY_ID="$ACCESS_KEY" AWS_SECRET_ACCESS_KEY="$SECRET_KEY" \
        "$DRIVER" --nats "$NATS" --policies "$dir/policies" --source-root "$SRC" --prefix bench/data \
        --dataset "bench-r$r-$verify" --scratch "$dir/scratch")
    kill "$copier"; wait "$copier" 2>/dev/null || true
    stop_weed
    rm -rf "$dir"
    log "stagehand ($verify): $line"
    python3 - "$line" "$verify" >>"$RESULTS" <<'PY'
import json, sys
d = json.loads(sys.argv[1])
print(f"stagehand {sys.argv[2]}\t{d['bytes']}\t{d['backup_secs']}")
print(f"drill\t{d['drill_bytes']}\t{d['drill_secs']}")
print(f"manifest\t{d['bytes']}\t{d['manifest_secs']}")
PY
}

run_rclone() {
    start_weed
    sync
    local t0 t1
    t0=$(now)
    rclone_env rclone --config /dev/null copy --checksum --transfers "$JOBS" --checkers "$JOBS" \
        --s3-upload-concurrency "$JOBS" --s3-chunk-size "${PART_MIB}M" --s3-upload-cutoff "${PART_MIB}M" \
        "$SRC/bench/data" bench:backup/rclone
    t1=$(now)
    stop_weed
    log "rclone: $(echo "$t1 - $t0" | bc -l | cut -c1-6) s"
    printf 'rclone --checksum\t%s\t%s\n' "$BYTES" "$(echo "$t1 - $t0" | bc -l)" >>"$RESULTS"
}

LOAD_BEFORE="$(uptime)"
for r in $(seq "$ROUNDS"); do
    log "round $r of $ROUNDS"
    if [ $((r % 2)) -eq 1 ]; then
        run_copier "$r" read-back; run_copier "$r" hashed-in-flight; run_rclone
    else
        run_rclone; run_copier "$r" hashed-in-flight; run_copier "$r" read-back
    fi
done
LOAD_AFTER="$(uptime)"

python3 - "$RESULTS" "$FILES" "$FILE_MIB" "$JOBS" "$PART_MIB" "$ROUNDS" "$LOAD_BEFORE" "$LOAD_AFTER" <<'PY'
import sys, collections, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
by = collections.OrderedDict()
for name, nbytes, secs in rows:
    by.setdefault(name, []).append((int(nbytes), float(secs)))
files, mib, jobs, part, rounds = sys.argv[2:7]
print(f"\nBackup of {files} x {mib} MiB to S3 (local SeaweedFS), {jobs} requests in flight, "
      f"{part} MiB parts, median of {rounds} rounds")
print(f"load before: {sys.argv[7].strip()}\nload after:  {sys.argv[8].strip()}\n")
base = statistics.median(s for _, s in by["rclone --checksum"])
print(f"{'run':<30}{'GiB':>6}{'MiB/s':>10}{'vs rclone':>11}   runs (s)")
for name, runs in by.items():
    b = runs[0][0]
    s = statistics.median(x for _, x in runs)
    ratio = f"{base / s:9.2f}x" if name.startswith(("stagehand", "rclone")) else ""
    print(f"{name:<30}{b / 2**30:6.2f}{b / s / 2**20:10.1f}{ratio:>11}   "
          + " ".join(f"{x:.2f}" for _, x in runs))
print("""
stagehand: publish of dataset.validated -> backup.completed, through the copier process: every
byte read from the source and hashed, uploaded with x-amz-checksum-sha256 per part (the server
checks it), the manifest stored inside the set, the completion marker written last; with
read-back, every object is read back from S3 and hashed before the marker. rclone --checksum
compares sizes and MD5s (ETags) and stores the MD5 in metadata; it reads nothing back.
drill: the manifest restored from the backup and checked against the version digest, then the
sample restored to local disk, every byte hashed against the manifest, the result published.
manifest: hashing the source to build the manifest (the validator's work, not the backup's).""")
PY
