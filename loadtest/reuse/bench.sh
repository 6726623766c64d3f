#!/usr/bin/env bash
# Checked before reuse: the fingerprint check of an already-staged version — a metadata walk of
# every file (parallel getdents + statx) compared with the fingerprint recorded at publish —
# against `find -printf '%s %T@ %C@ %i\n'` over the same tree (the same four facts per file,
# one thread, its output thrown away), in interleaved pairs (A B A B …, `PAIRS`, default 3),
# median of each; then the already-staged request → stage.ready latency (p50, p99) of a
# `STAGED_FILES`-file version through the real promoter, which now runs that check first.
#
#   loadtest/reuse/bench.sh                                  # 1,000,000 files; 10,000 staged
#   FILES=200000 PAIRS=5 loadtest/reuse/bench.sh             # a smaller tree, more pairs
#   BENCH_DIR=/dev/shm/reuse-bench loadtest/reuse/bench.sh   # the tree in memory
#   SKIP_STAGED=1 loadtest/reuse/bench.sh                    # the walk only
#
# The files are empty by default (`BYTES`): a walk reads no data, and a million 4 KiB files
# would take 4 GiB of a shared disk for nothing. The tree is made once under $BENCH_DIR
# (default: $CARGO_TARGET_DIR/reuse-bench) and kept. The page cache is warm for both tools:
# one unmeasured pass of each first. The load average is printed before and after: other work
# on the machine moves every figure.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
BENCH_DIR=${BENCH_DIR:-$CARGO_TARGET_DIR/reuse-bench}
FILES=${FILES:-1000000}
BYTES=${BYTES:-0}
PAIRS=${PAIRS:-3}
STAGED_FILES=${STAGED_FILES:-10000}
REQUESTS=${REQUESTS:-200}
PROFILE=${PROFILE:-release}

for tool in find python3; do
    command -v "$tool" >/dev/null || { echo "bench.sh needs $tool" >&2; exit 1; }
done
case "$PROFILE" in
release) FLAG=--release; BINDIR=$CARGO_TARGET_DIR/release ;;
dev) FLAG=; BINDIR=$CARGO_TARGET_DIR/debug ;;
*) echo "bench.sh: PROFILE is release or dev, not $PROFILE" >&2; exit 1 ;;
esac
(cd "$REPO" && cargo build $FLAG -p stagehand-loadtest --bin reuse-bench >&2)
[ -n "${SKIP_STAGED:-}" ] || (cd "$REPO" && cargo build $FLAG -p stagehand-loadtest --bin stage-bench >&2)
BIN=$BINDIR/reuse-bench

TREE=$BENCH_DIR/tier/v-$FILES-$BYTES
mkdir -p "$BENCH_DIR/tier"
if [ ! -f "$TREE.done" ]; then
    rm -rf "$TREE"
    echo "making $FILES files of $BYTES bytes under $TREE" >&2
    "$BIN" make --dir "$TREE" --files "$FILES" --bytes "$BYTES"
    touch "$TREE.done"
fi
"$BIN" record --dir "$TREE" --out "$BENCH_DIR/recorded" >&2
# Warm both: the first pass of either would pay for the other's cache misses.
"$BIN" check --dir "$TREE" --recorded "$BENCH_DIR/recorded" >/dev/null
find "$TREE" -printf '%s %T@ %C@ %i\n' >/dev/null

OUT=$BENCH_DIR/results.jsonl
: >"$OUT"
echo "load before: $(uptime)" >&2
now() { date +%s.%N; }
# Seconds between two `now`s, with the leading zero JSON needs (bc prints `.68`).
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.6f", b - a }'; }
for pair in $(seq "$PAIRS"); do
    t0=$(now)
    check=$("$BIN" check --dir "$TREE" --recorded "$BENCH_DIR/recorded")
    t1=$(now)
    printf '{"pair":%d,"tool":"stagehand","wall":%s,"check":%s}\n' "$pair" "$(secs "$t0" "$t1")" "$check" | tee -a "$OUT"
    t0=$(now)
    find "$TREE" -printf '%s %T@ %C@ %i\n' >/dev/null
    t1=$(now)
    printf '{"pair":%d,"tool":"find","wall":%s}\n' "$pair" "$(secs "$t0" "$t1")" | tee -a "$OUT"
done
echo "load after: $(uptime)" >&2

python3 - "$OUT" "$FILES" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
files = int(sys.argv[2])
def med(tool, key="wall"):
    return statistics.median(r[key] if key == "wall" else r["check"][key] for r in rows if r["tool"] == tool)
s, f = med("stagehand"), med("find")
walk = statistics.median(r["check"]["walk_seconds"] for r in rows if r["tool"] == "stagehand")
enc = next(r["check"]["encoded_bytes"] for r in rows if r["tool"] == "stagehand")
print(f"| files | fingerprint check (process wall) | of which the walk | find -printf | check / find | recorded fingerprint |")
print(f"| ---: | ---: | ---: | ---: | ---: | ---: |")
print(f"| {files:,} | {s:.3f} s | {walk:.3f} s | {f:.3f} s | {s / f:.2f}x (target <= 1.5x) | {enc / 1e6:.1f} MB |")
PY

if [ -z "${SKIP_STAGED:-}" ]; then
    # The real promoter's answer to a request for a version already on hot: the check first.
    "$BINDIR/stage-bench" --dir "$BENCH_DIR/stage" --small-files "$STAGED_FILES" --large-files 1 \
        --large-mib 1 --latency-requests "$REQUESTS" --concurrent 2 | tee -a "$OUT" | grep '"staged"' || true
fi
