#!/usr/bin/env bash
# Ingest benchmark (issue 7): `stagehand ingest --wait` end to end — walk, copy onto the source
# tier hashing every byte, manifest by reference, the validator hashing every byte again, the
# recorder folding the version — against `cp -r` followed by `sha256sum` of the copy, and
# `rclone copy --checksum`, on the same data, in one run. Two data sets: many small files, and
# a few large ones. Also printed: the SHA-256 limit of every core measured in the same run, and
# the peak RSS of the CLI and of `stagehand up` (nats-server aside: the validator, the recorder
# and the other services run inside it).
#
#   loadtest/ingest/bench.sh                                # 100,000 × 1 KiB, 40 × 64 MiB
#   SMALL_FILES=1000000 LARGE_FILES=1000 loadtest/ingest/bench.sh   # the issue's sizes
#   PROFILE=release SETS=large loadtest/ingest/bench.sh     # an optimised `stagehand`, large only
#
# Settings (environment): SETS (which data sets: `small large`), SMALL_FILES, SMALL_FOLDERS,
# SMALL_BYTES (per file), LARGE_FILES, LARGE_MIB (per file; the default 40 × 64 MiB = 2.5 GiB
# is on the disk at most three times at once: the source, the copy and its backup), PROFILE
# (dev | release; dev is what the suite builds — deps at
# opt-level 1, sha2 at 3, Stagehand's own crates unoptimised), BENCH_DIR (where the data and
# the home go; default a temp folder on the local disk; everything is deleted at the end),
# STAGEHAND_BIN (a `stagehand` binary to run instead of building one, e.g. to compare two
# builds), STAGEHAND_NATS_SERVER (default: deploy/servers.sh's venv).
#
# Every run is warm: the source tree was just written and sits in the page cache for all three
# pipelines alike, and was flushed (`sync`) before the first one, so that no pipeline pays for
# the generator's writeback (Stagehand's `syncfs` would otherwise write the whole source tree
# back; `cp -r` never waits for it). `stagehand up` backs every validated version up
# (policies/backup.toml); the copy is deleted and the next pipeline timed only once that backup
# is done, so it does not run beside them. Stagehand makes its copy durable (one syncfs per batch of renames); `cp -r`
# and rclone do not sync. The load average is printed first: other work on the machine moves
# every figure. Under the table, Stagehand's time by phase (the CLI's `--json` `seconds`):
# placing (walk, copy, hash, flush, publish), the request (manifest carried, published), the
# verdict (the validator reading and hashing every file) and the catalogue's fold.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=loadtest/stack.sh
. "$REPO/loadtest/stack.sh"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
SMALL_FILES=${SMALL_FILES:-100000}
SMALL_FOLDERS=${SMALL_FOLDERS:-100}
SMALL_BYTES=${SMALL_BYTES:-1024}
SETS=${SETS:-small large}
LARGE_FILES=${LARGE_FILES:-40}
LARGE_MIB=${LARGE_MIB:-64}
PROFILE=${PROFILE:-dev}
find_nats_server
command -v rclone >/dev/null || { echo "bench.sh: rclone is needed" >&2; exit 1; }

cd "$REPO"
if [ -n "${STAGEHAND_BIN:-}" ]; then
    BIN=$STAGEHAND_BIN PROFILE="given ($STAGEHAND_BIN)"
else
    case "$PROFILE" in
    dev) cargo build -q -p stagehand --bin stagehand; BIN=$CARGO_TARGET_DIR/debug/stagehand ;;
    release) cargo build -q --release -p stagehand --bin stagehand; BIN=$CARGO_TARGET_DIR/release/stagehand ;;
    *) echo "bench.sh: PROFILE is dev or release, not $PROFILE" >&2; exit 1 ;;
    esac
fi

WORK=$(mktemp -d "${BENCH_DIR:-${TMPDIR:-/tmp}}/stagehand-ingest-bench.XXXXXX")
UP_PID=
cleanup() {
    if [ -n "$UP_PID" ]; then
        kill -INT "$UP_PID" 2>/dev/null || true
        wait "$UP_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }
# Peak RSS in MiB of a finished command, from GNU time's "Maximum resident set size" (KiB).
peak_mib() { awk -F': ' '/Maximum resident set size/ {printf "%.0f", $2 / 1024}' "$1"; }
# Peak RSS in MiB of a running process.
hwm_mib() { awk '/VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }
rate() { echo "$1 / $2" | bc -l | xargs printf '%.0f'; }
gibs() { echo "$1 / $2 / 1073741824" | bc -l | xargs printf '%.3f'; }
ratio() { echo "$1 / $2" | bc -l | xargs printf '%.2f'; }

echo "load: $(uptime | sed 's/.*load average/load average/')   cores: $(nproc)   profile: $PROFILE"

# The SHA-256 limit: one sha256sum per core over the same cached 256 MiB.
head -c $((256 << 20)) /dev/urandom >"$WORK/sha-probe"
sha256sum "$WORK/sha-probe" >/dev/null
t0=$(now)
for _ in $(seq "$(nproc)"); do sha256sum "$WORK/sha-probe" >/dev/null & done
wait
t1=$(now)
SHA_GIBS=$(gibs $(($(nproc) * (256 << 20))) "$(secs "$t0" "$t1")")
rm -f "$WORK/sha-probe"
echo "sha256 limit of $(nproc) cores: $SHA_GIBS GiB/s"

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
env -u STAGEHAND_HOME -u STAGEHAND_NATS_URL STAGEHAND_NATS_SERVER="$NATS_SERVER" \
    RUST_LOG=warn,stagehand_backup_copier=info \
    "$BIN" up --home "$WORK/home" --port "$PORT" >"$WORK/up.out" 2>"$WORK/up.err" &
UP_PID=$!
wait_up "$UP_PID"
export STAGEHAND_NATS_URL=nats://127.0.0.1:$PORT

# One data set: generated, then each pipeline timed on it, its copy deleted before the next.
# Prints one table row per pipeline.
run() {
    local name=$1 files=$2 bytes=$3
    local src=$WORK/src-$name
    echo
    echo "== $name: $files files, $bytes bytes"
    printf '%-28s %9s %12s %9s %10s %s\n' pipeline seconds files/s GiB/s "ratio" "peak RSS MiB"

    sync
    # Stagehand: the CLI (placing, the manifest), then the validator and the recorder.
    local t0 t1 st
    t0=$(now)
    /usr/bin/time -v -o "$WORK/time-$name" "$BIN" ingest "$src" --project bench --dataset "$name" \
        --policies "$WORK/home/policies" --wait --timeout 3600 --json >"$WORK/report-$name.json"
    t1=$(now)
    st=$(secs "$t0" "$t1")
    grep -q '"validated"' "$WORK/report-$name.json" || { cat "$WORK/report-$name.json" >&2; exit 1; }
    local cli_rss up_rss
    cli_rss=$(peak_mib "$WORK/time-$name")
    up_rss=$(hwm_mib "$UP_PID")
    # The backup of the new version, before its copy goes and the next pipeline starts.
    for _ in $(seq 6000); do
        grep -q "backed up.*dataset=$name" "$WORK/up.err" && break
        sleep 0.1
    done
    grep -q "backed up.*dataset=$name" "$WORK/up.err" ||
        echo "bench.sh: the backup of $name did not finish in 600 s; going on" >&2
    rm -rf "$WORK/home/tiers/source/bench/$name" "$WORK/home/tiers/backup/bench/$name"

    # cp -r, then sha256sum of the copy.
    t0=$(now)
    cp -r "$src" "$WORK/cp-$name"
    # On every core: batches of a quarter of each core's share of the files.
    (cd "$WORK/cp-$name" && find . -type f -print0 |
        xargs -0 -P "$(nproc)" -n $((files / $(nproc) / 4 + 1)) sha256sum >/dev/null)
    t1=$(now)
    local ct
    ct=$(secs "$t0" "$t1")
    rm -rf "$WORK/cp-$name"

    # rclone copy --checksum (local to local: hashes both sides).
    t0=$(now)
    rclone copy -q --checksum --transfers "$(nproc)" --checkers "$(nproc)" "$src" "$WORK/rclone-$name"
    t1=$(now)
    local rt
    rt=$(secs "$t0" "$t1")
    rm -rf "$WORK/rclone-$name"

    printf '%-28s %9.2f %12s %9s %10s cli %s, up %s\n' "stagehand ingest --wait" "$st" \
        "$(rate "$files" "$st")" "$(gibs "$bytes" "$st")" "$(ratio "$ct" "$st")x" "$cli_rss" "$up_rss"
    printf '%-28s %9.2f %12s %9s %10s\n' "cp -r + sha256sum" "$ct" "$(rate "$files" "$ct")" \
        "$(gibs "$bytes" "$ct")" "1.00x"
    printf '%-28s %9.2f %12s %9s %10s\n' "rclone copy --checksum" "$rt" "$(rate "$files" "$rt")" \
        "$(gibs "$bytes" "$rt")" "$(ratio "$ct" "$rt")x"
    echo "(ratio: the cp -r + sha256sum time over the pipeline's time; above 1 is faster)"
    python3 - "$WORK/report-$name.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1])).get("seconds")
if s:
    print("stagehand by phase: place %.2f s, request %.2f s, verdict %.2f s, catalogue %.2f s"
          % (s["place"], s["request"], s["verdict"], s["catalogue"]))
EOF
    rm -rf "$src"
}

# Small files: distinct bytes per file, in folders.
if [[ " $SETS " == *" small "* ]]; then
SRC=$WORK/src-small
mkdir -p "$SRC"
python3 - "$SRC" "$SMALL_FILES" "$SMALL_FOLDERS" "$SMALL_BYTES" <<'EOF'
import os, sys
root, files, folders, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pad = os.urandom(size)
for d in range(folders):
    os.mkdir(f"{root}/d{d:04}")
for i in range(files):
    body = (f"{i}\n".encode() + pad)[:size]
    with open(f"{root}/d{i % folders:04}/f{i:07}.bin", "wb") as f:
        f.write(body)
EOF
run small "$SMALL_FILES" $((SMALL_FILES * SMALL_BYTES))
fi

# Large files.
if [[ " $SETS " == *" large "* ]]; then
SRC=$WORK/src-large
mkdir -p "$SRC"
for i in $(seq "$LARGE_FILES"); do
    head -c $((LARGE_MIB << 20)) /dev/urandom >"$SRC/shard-$i.bin"
done
run large "$LARGE_FILES" $((LARGE_FILES * (LARGE_MIB << 20)))
fi
echo
echo "load after: $(uptime | sed 's/.*load average/load average/')"
