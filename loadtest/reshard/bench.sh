#!/usr/bin/env bash
# Resharding benchmark: many small files (4–64 KiB, two per sample) packed into 256 MiB
# WebDataset shards by the real stagehand-resharder process — seeded shuffle, every member
# re-hashed against the manifest, every shard hashed and made durable, published as one set —
# next to, on the same files in the same run, in interleaved rounds:
#   - `tar -cf` (no hashing, no shuffle, no fsync),
#   - `tar + sha256sum`: every member hashed (`sha256sum` on both cores), the archive written
#     through `sha256sum` and fsynced — the same hashing and durability as the resharder,
#   - the webdataset package's ShardWriter (no hashing, no fsync).
# Prints files/s, GiB/s, peak RSS and the ratios.
#
#   loadtest/reshard/bench.sh                       # 28,000 files (~0.95 GiB), 3 rounds
#   FILES=200000 REPS=1 loadtest/reshard/bench.sh   # the issue's 200,000 files (~6.7 GiB)
#
# The default is scaled down from the issue's 200,000 files so that the raw files and one
# tool's output stay under 2 GiB of disk together.
#
# Settings: FILES (28000), MIN_SIZE / MAX_SIZE (4096 / 65536 bytes), SHARD_SIZE ("256 MiB"),
# REPS (3), READ_THREADS (4), BENCH_DIR (where the data goes; default /tmp), PROFILE (release
# | dev: the build the resharder is timed with), BIN_DIR (prebuilt binaries: nothing is built), PYTHON (default:
# the venv of deploy/servers.sh), STAGEHAND_NATS_SERVER (nats-server; the venv's by default).
# The data (the raw files, and one tool's output at a time) is deleted when the script ends.
# Targets: the resharder >= 2x ShardWriter and within 1.5x of plain tar (tar hashes nothing,
# shuffles nothing and syncs nothing).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$REPO/loadtest/reshard"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
FILES=${FILES:-28000}
MIN_SIZE=${MIN_SIZE:-4096}
MAX_SIZE=${MAX_SIZE:-65536}
SHARD_SIZE=${SHARD_SIZE:-256 MiB}
REPS=${REPS:-3}
READ_THREADS=${READ_THREADS:-4}
BENCH_DIR=${BENCH_DIR:-/tmp}
PROFILE=${PROFILE:-release}
STAGEHAND_HOME_DEFAULT="$REPO/.stagehand"
PYTHON=${PYTHON:-$STAGEHAND_HOME_DEFAULT/venv/bin/python}
if [ -z "${STAGEHAND_NATS_SERVER:-}" ] && [ -x "$STAGEHAND_HOME_DEFAULT/venv/bin/nats-server" ]; then
    export STAGEHAND_NATS_SERVER="$STAGEHAND_HOME_DEFAULT/venv/bin/nats-server"
fi
"$PYTHON" -c 'import webdataset' 2>/dev/null ||
    { echo "bench.sh: $PYTHON lacks webdataset; run deploy/servers.sh install" >&2; exit 1; }

shard_bytes=$("$PYTHON" - "$SHARD_SIZE" <<'PY'
import re, sys
n, unit = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", sys.argv[1]).groups()
print(int(n) * {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit])
PY
)

cd "$REPO"
echo "# load before building: $(uptime)"
. "$HERE/bins.sh"
reshard_bins bench.sh

WORK=$(mktemp -d "$BENCH_DIR/stagehand-reshard-bench.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
SRC="$WORK/source"
RAW="$SRC/bench/raw"
OUT="$WORK/out"
RESULTS="$WORK/results.jsonl"
"$PYTHON" "$HERE/gen.py" "$RAW" "$FILES" "$MIN_SIZE" "$MAX_SIZE"
# Warm the page cache for every tool alike (and hash once: the manifest the validator would
# have published, cached for the rounds).
find "$RAW" -type f -print0 | xargs -0 cat >/dev/null
"$BIN/reshard-bench" --source-root "$SRC" --prefix bench/raw --work "$WORK/stagehand" \
    --resharder "$BIN/stagehand-resharder" --shard-size "$SHARD_SIZE" \
    --read-threads "$READ_THREADS" --dataset warm-up >/dev/null

for round in $(seq 1 "$REPS"); do
    echo "# round $round: $(uptime)"
    mkdir -p "$OUT"
    /usr/bin/time -f '%e %M' -o "$WORK/tar.time" tar -cf "$OUT/all.tar" -C "$SRC/bench" raw
    read -r secs rss_kib <"$WORK/tar.time"
    tar_bytes=$(stat -c %s "$OUT/all.tar")
    echo "{\"tool\": \"tar -cf\", \"seconds\": $secs, \"peak_rss_bytes\": $((rss_kib * 1024)), \"out_bytes\": $tar_bytes}" >>"$RESULTS"
    rm -rf "$OUT"

    mkdir -p "$OUT"
    /usr/bin/time -f '%e %M' -o "$WORK/tarsum.time" bash -c '
        set -euo pipefail
        cd "$1/bench"
        find raw -type f -print0 | xargs -0 -P 2 -n 4096 sha256sum >"$2/members.sha256"
        tar -cf - raw | tee "$2/all.tar" | sha256sum >"$2/all.tar.sha256"
        sync "$2/all.tar"' _ "$SRC" "$OUT"
    read -r secs rss_kib <"$WORK/tarsum.time"
    hashed=$(wc -l <"$OUT/members.sha256")
    [ "$hashed" -eq "$FILES" ] || { echo "bench.sh: sha256sum hashed $hashed files of $FILES" >&2; exit 1; }
    echo "{\"tool\": \"tar + sha256sum\", \"seconds\": $secs, \"peak_rss_bytes\": $((rss_kib * 1024))}" >>"$RESULTS"
    rm -rf "$OUT"

    "$PYTHON" "$HERE/shardwriter.py" "$RAW" "$OUT" "$shard_bytes" >>"$RESULTS"
    rm -rf "$OUT"

    "$BIN/reshard-bench" --source-root "$SRC" --prefix bench/raw --work "$WORK/stagehand" \
        --resharder "$BIN/stagehand-resharder" --shard-size "$SHARD_SIZE" \
        --read-threads "$READ_THREADS" --dataset "round-$round" >>"$RESULTS"
done
echo "# load after: $(uptime)"

"$PYTHON" - "$RESULTS" "$FILES" <<'PY'
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1])]
stagehand = [r for r in rows if r["tool"] == "stagehand-resharder"]
files, raw_bytes = stagehand[0]["files"], stagehand[0]["bytes"]
by_tool = {}
for r in rows:
    by_tool.setdefault(r["tool"], []).append(r)
print(f"\n{files} files, {raw_bytes / 2**30:.2f} GiB ({raw_bytes / files / 1024:.1f} KiB mean), "
      f"{stagehand[0]['samples']} samples, {stagehand[0]['shards']} shards; medians of {len(stagehand)} rounds")
print(f"{'tool':<24} {'seconds':>8} {'files/s':>10} {'GiB/s':>7} {'peak RSS':>10}  rounds (s)")
median = {}
for tool in ["tar -cf", "tar + sha256sum", "webdataset-shardwriter", "stagehand-resharder"]:
    rs = by_tool[tool]
    s = statistics.median(r["seconds"] for r in rs)
    median[tool] = s
    rss = max(r["peak_rss_bytes"] for r in rs) / 2**20
    print(f"{tool:<24} {s:>8.2f} {files / s:>10.0f} {raw_bytes / s / 2**30:>7.2f} {rss:>8.0f} MiB  "
          + " ".join(f"{r['seconds']:.2f}" for r in rs))
cpu = statistics.median(r["cpu_seconds"] / r["seconds"] for r in stagehand)
print(f"\nstagehand-resharder used {cpu:.2f} cores on average (user + system CPU / wall time)")
print(f"stagehand vs ShardWriter: {median['webdataset-shardwriter'] / median['stagehand-resharder']:.2f}x faster (target >= 2x)")
print(f"stagehand vs tar -cf:     {median['stagehand-resharder'] / median['tar -cf']:.2f}x tar's time (target <= 1.5x)")
print(f"stagehand vs tar + sha256sum: {median['stagehand-resharder'] / median['tar + sha256sum']:.2f}x its time")
PY
