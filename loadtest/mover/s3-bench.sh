#!/usr/bin/env bash
# S3 benchmark: Stagehand's mover against `rclone copy` at equal concurrency, both directions,
# on one 1 GiB file and on 2,000 x 64 KiB files, against a local SeaweedFS S3 server started by
# deploy/servers.sh on its own ports and data directory (stopped and removed at the end).
#
#   loadtest/mover/s3-bench.sh
#
# Settings (environment): BENCH_DIR (scratch space, default a temp dir), BENCH_JOBS (files and
# requests in flight, default 8), BENCH_PART_MIB (part size, default 16), BENCH_BIG_MIB (size of
# the large file, default 1024), BENCH_SMALL_COUNT (default 2000), BENCH_ROUNDS (default 3),
# STAGEHAND_CP (a prebuilt stagehand-mover-cp; otherwise it is built with the bench-release
# profile).
#
# Each round runs every case with both tools, into fresh buckets and fresh directories, the
# tools' order alternating from round to round; the table shows the median of the rounds, so a
# neighbour's burst of CPU on a shared machine moves one sample, not the result. Nothing is
# deleted between runs: on ext4, files deleted just before make the next creates slower
# (recently deleted inodes are skipped), which would tax whichever tool runs second.
#
# Equal concurrency means: rclone --transfers J --checkers J --s3-upload-concurrency J
# --multi-thread-streams J --s3-chunk-size P, and Stagehand --concurrency J with
# STAGEHAND_S3_CONCURRENCY=J (requests in flight) and STAGEHAND_S3_PART_SIZE=P. Stagehand
# verifies SHA-256 end to end and publishes downloads durably (fsync); rclone checks sizes and
# MD5/ETags where it can and does not fsync.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
JOBS="${BENCH_JOBS:-8}"
PART_MIB="${BENCH_PART_MIB:-16}"
BIG_MIB="${BENCH_BIG_MIB:-1024}"
SMALL_COUNT="${BENCH_SMALL_COUNT:-2000}"
ROUNDS="${BENCH_ROUNDS:-3}"
WORK="${BENCH_DIR:-$(mktemp -d /tmp/stagehand-s3-bench.XXXXXX)}"
mkdir -p "$WORK"

log() { printf 's3-bench: %s\n' "$*" >&2; }

command -v rclone >/dev/null || { log "rclone is missing: deploy/servers.sh install --bench"; exit 1; }

# --- the S3 server (deploy/servers.sh; reused when already running, else started and stopped) --
port_open() { python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1",int(sys.argv[1])),1)' "$1" 2>/dev/null; }
S3_PORT="${STAGEHAND_S3_PORT:-8333}"
STARTED=0
BUCKETS=()
cleanup() {
    if [ "$STARTED" -eq 0 ]; then # a server that outlives the run keeps no benchmark buckets
        for b in "${BUCKETS[@]}"; do rclone_env rclone --config /dev/null purge "bench:$b" >/dev/null 2>&1 || true; done
    else
        "$REPO/deploy/servers.sh" stop s3 >/dev/null 2>&1 || true
    fi
    [ -n "${BENCH_DIR:-}" ] || rm -rf "$WORK"
}
trap cleanup EXIT
if ! port_open "$S3_PORT"; then
    "$REPO/deploy/servers.sh" start s3 >&2
    STARTED=1
fi
eval "$("$REPO/deploy/servers.sh" env)"
ENDPOINT="http://127.0.0.1:$S3_PORT"
export STAGEHAND_S3_ENDPOINT="$ENDPOINT" NO_PROXY="127.0.0.1,localhost"
export STAGEHAND_S3_CONCURRENCY="$JOBS" STAGEHAND_S3_PART_SIZE=$((PART_MIB * 1024 * 1024))

# --- the binary ----------------------------------------------------------------------------
CP="${STAGEHAND_CP:-}"
if [ -z "$CP" ]; then
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$REPO/target}"
    (cd "$REPO" && cargo build -q --profile bench-release -p stagehand-mover --bin stagehand-mover-cp)
    CP="$CARGO_TARGET_DIR/bench-release/stagehand-mover-cp"
fi

# rclone: an S3 remote from the environment only; AWS_CA_BUNDLE breaks rclone 1.60's S3 client.
rclone_env() {
    env -u AWS_CA_BUNDLE \
        RCLONE_CONFIG_BENCH_TYPE=s3 RCLONE_CONFIG_BENCH_PROVIDER=Other \
        RCLONE_CONFIG_BENCH_ENV_AUTH=false \
        RCLONE_CONFIG_BENCH_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" \
        RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY" \
        RCLONE_CONFIG_BENCH_ENDPOINT="$ENDPOINT" RCLONE_CONFIG_BENCH_REGION=us-east-1 \
        RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE=true "$@"
}
rclone_s3() {
    rclone_env rclone --config /dev/null copy --transfers "$JOBS" --checkers "$JOBS" \
        --s3-upload-concurrency "$JOBS" --multi-thread-streams "$JOBS" \
        --s3-chunk-size "${PART_MIB}M" --s3-upload-cutoff "${PART_MIB}M" "$@"
}
# `stagehand_cp SRC DST`: a recursive copy; the binary takes its options as one JSON argument.
stagehand_cp() {
    "$CP" "{\"src\":\"$1\",\"dst\":\"$2\",\"recursive\":true,\"concurrency\":$JOBS}" >/dev/null
}

# --- data ----------------------------------------------------------------------------------
log "making data in $WORK"
mkdir -p "$WORK/big" "$WORK/small"
head -c $((BIG_MIB * 1024 * 1024)) /dev/urandom >"$WORK/big/big.bin"
python3 - "$WORK/small" "$SMALL_COUNT" <<'PY'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    d = os.path.join(root, f"d{i % 20:02d}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i:05d}.bin"), "wb") as f:
        f.write(os.urandom(64 * 1024))
PY
BIG_BYTES=$((BIG_MIB * 1024 * 1024))
SMALL_BYTES=$((SMALL_COUNT * 64 * 1024))

make_bucket() { rclone_env rclone --config /dev/null mkdir "bench:$1"; } # fresh per tool

now() { date +%s.%N; }
RESULTS="$WORK/results.tsv"
: >"$RESULTS"
run() { # name tool bytes files command...
    local name="$1" tool="$2" bytes="$3" files="$4"; shift 4
    sync
    local t0 t1
    t0=$(now)
    "$@"
    t1=$(now)
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$tool" "$bytes" "$files" "$(echo "$t1 - $t0" | bc -l)" >>"$RESULTS"
    log "$name $tool: $(echo "$t1 - $t0" | bc -l | cut -c1-6) s"
}

one_round() { # round tool
    local r="$1" tool="$2"
    local bucket="bench-$tool-$r-$$"
    make_bucket "$bucket"
    BUCKETS+=("$bucket")
    local down="$WORK/down-$tool-$r"
    mkdir -p "$down/big" "$down/small"
    if [ "$tool" = stagehand ]; then
        run "${BIG_MIB} MiB up" "$tool" "$BIG_BYTES" 1 stagehand_cp "$WORK/big" "s3://$bucket/big"
        run "${SMALL_COUNT}x64KiB up" "$tool" "$SMALL_BYTES" "$SMALL_COUNT" stagehand_cp "$WORK/small" "s3://$bucket/small"
        sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
        run "${BIG_MIB} MiB down" "$tool" "$BIG_BYTES" 1 stagehand_cp "s3://$bucket/big" "$down/big"
        run "${SMALL_COUNT}x64KiB down" "$tool" "$SMALL_BYTES" "$SMALL_COUNT" stagehand_cp "s3://$bucket/small" "$down/small"
    else
        run "${BIG_MIB} MiB up" "$tool" "$BIG_BYTES" 1 rclone_s3 "$WORK/big" "bench:$bucket/big"
        run "${SMALL_COUNT}x64KiB up" "$tool" "$SMALL_BYTES" "$SMALL_COUNT" rclone_s3 "$WORK/small" "bench:$bucket/small"
        sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
        run "${BIG_MIB} MiB down" "$tool" "$BIG_BYTES" 1 rclone_s3 "bench:$bucket/big" "$down/big"
        run "${SMALL_COUNT}x64KiB down" "$tool" "$SMALL_BYTES" "$SMALL_COUNT" rclone_s3 "bench:$bucket/small" "$down/small"
    fi
    # Both tools must have moved every byte intact.
    cmp "$WORK/big/big.bin" "$down/big/big.bin"
    diff -r "$WORK/small" "$down/small" >/dev/null
}

for r in $(seq "$ROUNDS"); do
    log "round $r of $ROUNDS"
    if [ $((r % 2)) -eq 1 ]; then order="stagehand rclone"; else order="rclone stagehand"; fi
    for tool in $order; do one_round "$r" "$tool"; done
done

python3 - "$RESULTS" "$JOBS" "$PART_MIB" "$ROUNDS" <<'PY'
import sys, collections, statistics
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
by = collections.OrderedDict()
for name, tool, nbytes, files, secs in rows:
    by.setdefault(name, {}).setdefault(tool, []).append((int(nbytes), int(files), float(secs)))
print(f"\nS3 transfers, {sys.argv[2]} in flight, {sys.argv[3]} MiB parts (local SeaweedFS), "
      f"median of {sys.argv[4]} rounds\n")
print(f"{'case':<18}{'stagehand':>16}{'rclone':>16}{'ratio':>8}   stagehand runs (s) | rclone runs (s)")
for name, t in by.items():
    def med(runs):
        b, f, _ = runs[0]
        return b, f, statistics.median(s for _, _, s in runs)
    def fmt(v):
        b, f, s = v
        return f"{b / s / 2**20:8.1f} MiB/s" if f == 1 else f"{f / s:7.0f} files/s"
    def spread(runs):
        return " ".join(f"{s:.2f}" for _, _, s in runs)
    s, r = med(t["stagehand"]), med(t["rclone"])
    print(f"{name:<18}{fmt(s):>16}{fmt(r):>16}{r[2] / s[2]:7.2f}x   "
          f"{spread(t['stagehand'])} | {spread(t['rclone'])}")
print("""
Notes: Stagehand proves every file's SHA-256 end to end (uploads send x-amz-checksum-sha256 per
PUT or part and record the whole-file hash; downloads hash what they write and compare it with
the recorded hash), writes each download to a temp file and renames it into place only after it
is durable (one syncfs per batch before the renames, one after). rclone checks sizes and
MD5/ETags where it can, writes in place and does not sync: its downloads may still sit in the
page cache when it exits. Each tool downloads what it uploaded itself.""")
PY
