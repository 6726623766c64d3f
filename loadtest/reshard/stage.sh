#!/usr/bin/env bash
# What packing buys when staging: a raw version of N × 4 KiB files is validated (published by
# reference, as the ingest validator does), resharded by the real stagehand-resharder process
# into its prepared version, and then both are staged to a posix hot tier through the real
# promoter (with the catalogue recorder, in one process as `loadtest/stage/bench.sh` runs
# them) — the raw version (form `raw`) and the prepared one (form `prepared`): the same
# bytes, N files against a few shards. Each is timed from `stage.requested` to `stage.ready`;
# the ratio is printed.
#
#   loadtest/reshard/stage.sh                       # 100,000 × 4 KiB (~0.4 GiB raw)
#   FILES=20000 loadtest/reshard/stage.sh           # a smaller run
#   BENCH_DIR=/dev/shm loadtest/reshard/stage.sh    # every tier in memory (no disk)
#   SOURCE_CACHE=warm loadtest/reshard/stage.sh     # both versions read from the page cache
#
# Both versions start from the same place: evicted from the page cache (SOURCE_CACHE=cold, the
# default: a version on a capacity tier is read from its disks) or read into it first (warm).
#
# Settings: FILES (100000), FILE_SIZE (4096), SHARD_SIZE ("256 MiB"), READ_THREADS (4),
# SOURCE_CACHE (cold | warm), BENCH_DIR (default /tmp), PROFILE (release | dev), BIN_DIR
# (prebuilt stagehand-resharder and reshard-bench binaries: nothing is built), PYTHON,
# STAGEHAND_NATS_SERVER.
# Disk: the raw files, the shards and both hot copies (~1.7 GiB at the default), all deleted
# when the script ends. Target: staging the prepared version >= 5x faster than the raw one.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$REPO/loadtest/reshard"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
FILES=${FILES:-100000}
FILE_SIZE=${FILE_SIZE:-4096}
SHARD_SIZE=${SHARD_SIZE:-256 MiB}
READ_THREADS=${READ_THREADS:-4}
SOURCE_CACHE=${SOURCE_CACHE:-cold}
BENCH_DIR=${BENCH_DIR:-/tmp}
PROFILE=${PROFILE:-release}
STAGEHAND_HOME_DEFAULT="$REPO/.stagehand"
PYTHON=${PYTHON:-$STAGEHAND_HOME_DEFAULT/venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
if [ -z "${STAGEHAND_NATS_SERVER:-}" ] && [ -x "$STAGEHAND_HOME_DEFAULT/venv/bin/nats-server" ]; then
    export STAGEHAND_NATS_SERVER="$STAGEHAND_HOME_DEFAULT/venv/bin/nats-server"
fi

cd "$REPO"
. "$HERE/bins.sh"
reshard_bins stage.sh

WORK=$(mktemp -d "$BENCH_DIR/stagehand-reshard-stage.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
SRC="$WORK/source"
RAW="$SRC/bench/raw"
RESULTS="$WORK/results.jsonl"
"$PYTHON" "$HERE/gen.py" "$RAW" "$FILES" "$FILE_SIZE" "$FILE_SIZE" >&2
echo "# load before: $(uptime)"
"$BIN/reshard-bench" --source-root "$SRC" --prefix bench/raw --work "$WORK/stagehand" \
    --resharder "$BIN/stagehand-resharder" --shard-size "$SHARD_SIZE" \
    --read-threads "$READ_THREADS" --dataset small-files --stage-to-hot \
    --source-cache "$SOURCE_CACHE" | tee "$RESULTS"
echo "# load after: $(uptime)"

"$PYTHON" - "$RESULTS" <<'PY'
import json, sys

rows = {r["tool"]: r for r in map(json.loads, open(sys.argv[1]))}
resharded, raw, prepared = rows["stagehand-resharder"], rows["stage raw"], rows["stage prepared"]
print(f"\nraw version: {raw['files']} files, {raw['bytes'] / 2**20:.1f} MiB; prepared: "
      f"{prepared['files']} files ({resharded['shards']} shards), {prepared['bytes'] / 2**20:.1f} MiB; "
      f"resharded in {resharded['seconds']:.2f} s")
print(f"{'staged to hot':<24} {'seconds':>8} {'files/s':>10} {'MiB/s':>8}")
for name, r in [("raw (form raw)", raw), ("prepared (form prepared)", prepared)]:
    print(f"{name:<24} {r['seconds']:>8.2f} {r['files'] / r['seconds']:>10.0f} "
          f"{r['bytes'] / 2**20 / r['seconds']:>8.1f}")
print(f"\nstaging the prepared version: {raw['seconds'] / prepared['seconds']:.2f}x faster than "
      f"the raw one (target >= 5x)")
PY
