#!/usr/bin/env bash
# The demoter draining a hot tier from 95 % of its capacity to its low watermark — 200 versions
# of mixed sizes (1–8 files, five size classes), each one's only verified copy on hot, so every
# demotion copies down to capacity, reads it back and announces it before it removes the hot
# copy — beside `rsync -a --remove-source-files` moving the same version folders (unverified).
# The demoter runs as its real binary; its CPU time and peak RSS are read from /proc.
#
#   loadtest/demote/bench.sh                                  # 200 versions, 1.5 GiB, low 0.5
#   VERSIONS=200 TOTAL_MIB=1024 LOW=0.7 loadtest/demote/bench.sh
#   MAX_CONCURRENT=1 loadtest/demote/bench.sh                 # one step at a time (default 8)
#   PROFILE=dev loadtest/demote/bench.sh                      # no release build (slower code)
#   LOG_LEVEL=info loadtest/demote/bench.sh                   # each step's timeline in demote-bench.demoter.log
#
# The issue's benchmark holds 20 GiB (TOTAL_MIB=20480: about 30 GB of free disk at the peak); the
# default is 1.5 GiB. Both tools start from data on disk (flushed after it is written).
# Everything is made under $BENCH_DIR (default $CARGO_TARGET_DIR/demote-bench), on one
# filesystem for both tools, and removed at the end. The load average is printed: other work on
# the machine moves every figure.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
BENCH_DIR=${BENCH_DIR:-$CARGO_TARGET_DIR/demote-bench}
VERSIONS=${VERSIONS:-200}
TOTAL_MIB=${TOTAL_MIB:-1536}
LOW=${LOW:-0.5}
PROFILE=${PROFILE:-release}
MAX_CONCURRENT=${MAX_CONCURRENT:-8}

command -v rsync >/dev/null || { echo "bench.sh needs rsync (Debian: apt-get install rsync)" >&2; exit 1; }
[ -n "${STAGEHAND_NATS_SERVER:-}" ] || eval "$("$REPO/deploy/servers.sh" env)"
if [ "$PROFILE" = dev ]; then
    (cd "$REPO" && cargo build -p stagehand-loadtest -p stagehand-demoter --bin demote-bench --bin stagehand-demoter >&2)
    OUT_DIR=$CARGO_TARGET_DIR/debug
else
    (cd "$REPO" && cargo build --release -p stagehand-loadtest -p stagehand-demoter --bin demote-bench --bin stagehand-demoter >&2)
    OUT_DIR=$CARGO_TARGET_DIR/release
fi
echo "load before: $(uptime)" >&2
RESULTS=$("$OUT_DIR/demote-bench" --dir "$BENCH_DIR" --demoter "$OUT_DIR/stagehand-demoter" \
    --versions "$VERSIONS" --total-mib "$TOTAL_MIB" --low "$LOW" --max-concurrent "$MAX_CONCURRENT" --log-level "${LOG_LEVEL:-warn}")
echo "load after: $(uptime)" >&2
echo "$RESULTS"
python3 - "$PROFILE" <<PY
import json, sys
rows = {r["case"]: r for r in (json.loads(l) for l in """$RESULTS""".splitlines() if l.strip())}
d, r = rows["demote"], rows["rsync"]
print(f"profile {sys.argv[1]}, max_concurrent $MAX_CONCURRENT: {d['moved_versions']} of {d['versions']} versions, {d['moved_bytes'] / 2**20:.0f} MiB moved")
print(f"demoter (copy down + read back + facts + removal): {d['seconds']:.2f} s, {d['mib_per_s']:.0f} MiB/s, CPU {d['cpu_seconds']:.2f} s, peak RSS {d['peak_rss_bytes'] / 2**20:.0f} MiB")
print(f"rsync -a --remove-source-files (unverified):       {r['seconds']:.2f} s, {r['mib_per_s']:.0f} MiB/s")
print(f"rsync, then sync -f of the destination (durable):  {r['seconds_with_sync']:.2f} s")
print(f"ratio demoter / rsync: {d['seconds'] / r['seconds']:.2f}; / rsync + sync: {d['seconds'] / r['seconds_with_sync']:.2f} (target 1.2)")
PY
