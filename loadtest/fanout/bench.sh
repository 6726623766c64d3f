#!/usr/bin/env bash
# Fan-out benchmark (issue 17 item 1): node agents staging one version onto 1, 4 and 8 nodes'
# local tiers at once, fetching pieces from each other as well as from the shared hot tier,
# against N parallel `rclone copy --checksum` of the same version from the hot tier. Each node
# is a network namespace on one bridge with an address of its own; its agent is the real
# `stagehand-promoter` (`node = ...`, `[service.fanout]`) run in it with `ip netns exec`; NATS
# and `stagehand up --external-nats` (recorder, validator, shared promoter) run on the host,
# NATS bound to the bridge. Two versions: a few large files, and many small ones.
#
#   loadtest/fanout/bench.sh                       # 4 × 512 MiB and 100,000 × 4 KiB; 1, 4, 8 nodes
#   LARGE_MIB=16 SMALL_FILES=2000 PAIRS=3 PROFILE=dev loadtest/fanout/bench.sh   # a quick run
#   NODES="8" SETS=large loadtest/fanout/bench.sh  # eight nodes, the large version only
#
# Figures, for each version and number of nodes N: bytes the agents read from the shared tier
# (the sum of their `stagehand_fanout_bytes_total{source="shared"}`) ÷ the version's size; bytes
# fetched from peers; time from the first request to every node ready; the same N copies by N
# parallel `rclone copy --checksum` from the hot replica. Runs alternate, stagehand then rclone,
# PAIRS times (at least 3); the table gives medians and the median of the per-pair ratios
# (rclone's time ÷ stagehand's: above 1, the fan-out is faster).
#
# Each stagehand run starts from nothing, as a new version would: the agents are started afresh
# under node names of their own (`r<run>n<i>`, own state and local root), the fan-out board
# (the stream of KV bucket `stagehand_swarms`) is purged, and the replicas of the run before
# are deleted. Every node shares this machine's disk and cores, so the figures say how much
# the shared tier is read (the point of fan-out) more than how fast a cluster would be: eight
# nodes here write eight copies to one disk. The hot replica is in the page cache for both
# tools (it was just written or read).
#
# Settings (environment): SETS (`large small`), NODES (`1 4 8`), PAIRS (3), LARGE_FILES (4),
# LARGE_MIB (512), SMALL_FILES (100000), SMALL_BYTES (4096), PROFILE (release | dev), BENCH_DIR
# (where the data and the home go; default a temp folder; deleted at the end), VERIFY (how the
# agents prove each copy, promotion.toml's `verify`: unset keeps the shipped `read-back`, which
# reads every file back from the device uncached; `hashed-in-flight` checks the bytes as they
# are written and reads nothing twice), STAGEHAND_NATS_SERVER. Needs root (network namespaces), iproute2, rclone, python3, curl, bc.
# Disk: the source and hot copies of each version, plus N local copies during a run.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
SETS=${SETS:-large small}
NODES=${NODES:-1 4 8}
PAIRS=${PAIRS:-3}
LARGE_FILES=${LARGE_FILES:-4}
LARGE_MIB=${LARGE_MIB:-512}
SMALL_FILES=${SMALL_FILES:-100000}
SMALL_BYTES=${SMALL_BYTES:-4096}
PROFILE=${PROFILE:-release}
PROJECT=bench
METRICS_PORT=9466
FANOUT_PORT=7700

[ "$(id -u)" = 0 ] || { echo "bench.sh: needs root (network namespaces: ip netns, veth, bridge)" >&2; exit 1; }
for tool in ip rclone python3 curl bc; do
    command -v "$tool" >/dev/null || { echo "bench.sh needs $tool (deploy/servers.sh install --bench)" >&2; exit 1; }
done
[ "$PAIRS" -ge 3 ] || { echo "bench.sh: PAIRS is at least 3" >&2; exit 1; }
# Every command below is told its home, policies and server.
unset STAGEHAND_HOME
# shellcheck source=loadtest/stack.sh
. "$REPO/loadtest/stack.sh"
cd "$REPO"
build_bins

WORK=$(mktemp -d "${BENCH_DIR:-${TMPDIR:-/tmp}}/stagehand-fanout-bench.XXXXXX")
HOME_DIR=$WORK/home
# Names as the test kit's NodeNetwork makes them, with this shell's pid (≤ 15 characters).
TAG=shf$(printf '%x' $$)
MAXN=0
for n in $NODES; do [ "$n" -gt "$MAXN" ] && MAXN=$n; done
cleanup() {
    stop_stack
    for i in $(seq 0 $((MAXN - 1))); do
        ip netns delete "${TAG}n$i" 2>/dev/null || true
        ip link delete "${TAG}v$i" 2>/dev/null || true
    done
    ip link delete "${TAG}b" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }

echo "load: $(uptime | sed 's/.*load average/load average/')   cores: $(nproc)   profile: $PROFILE"

# The network: a bridge with a /24 no address of this host is in, one namespace per node.
SUBNET=
for k in $(seq 0 $((56 * 256 - 1))); do
    c=$(( ($$ + k) % (56 * 256) ))
    cand="10.$((200 + c / 256)).$((c % 256))"
    ip -4 -o addr show | grep -q " inet $cand\." || { SUBNET=$cand; break; }
done
[ -n "$SUBNET" ] || { echo "bench.sh: no free /24 under 10.200.0.0/13" >&2; exit 1; }
HOST=$SUBNET.1
ip link add "${TAG}b" type bridge
ip addr add "$HOST/24" dev "${TAG}b"
ip link set "${TAG}b" up
node_ip() { echo "$SUBNET.$(($1 + 2))"; }
for i in $(seq 0 $((MAXN - 1))); do
    ip netns add "${TAG}n$i"
    ip link add "${TAG}v$i" type veth peer name eth0 netns "${TAG}n$i"
    ip link set "${TAG}v$i" master "${TAG}b"
    ip link set "${TAG}v$i" up
    ip -n "${TAG}n$i" addr add "$(node_ip "$i")/24" dev eth0
    ip -n "${TAG}n$i" link set eth0 up
    ip -n "${TAG}n$i" link set lo up
done

# NATS on the bridge, the stack on it.
start_stack "$HOST" "$HOME_DIR"
POLICIES=$HOME_DIR/policies
if [ -n "${VERIFY:-}" ]; then
    # Every agent copies these policies as it starts (write_agent_config).
    sed -i "s/^verify = .*/verify = \"$VERIFY\"/" "$POLICIES/promotion.toml"
    grep -q "^verify = \"$VERIFY\"" "$POLICIES/promotion.toml" ||
        { echo "bench.sh: promotion.toml has no verify line to set" >&2; exit 1; }
fi
echo "# agents verify: $(grep '^verify' "$POLICIES/promotion.toml")"
SH=("$BIN/stagehand")
export STAGEHAND_PROJECT=$PROJECT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/fanout.token"
chmod 600 "$WORK/fanout.token"

# Empties the fan-out board: a purge of its KV stream, one JetStream API request.
purge_board() {
    python3 - "$HOST" "$NATS_PORT" <<'EOF'
import json, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
f = s.makefile("rb")
f.readline()  # INFO
s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nSUB _INBOX.purge 1\r\n'
          b'PUB $JS.API.STREAM.PURGE.KV_stagehand_swarms _INBOX.purge 0\r\n\r\n')
while True:
    line = f.readline()
    if not line or line.startswith(b"-ERR"):
        sys.exit(f"purging the fan-out board: {line!r}")
    if line.startswith(b"PING"):
        s.sendall(b"PONG\r\n")
    elif line.startswith(b"MSG"):
        n = int(line.split()[-1])
        reply = json.loads(f.read(n + 2)[:n])
        if "error" in reply and reply["error"].get("err_code") != 10059:  # no stream yet
            sys.exit(f"purging the fan-out board: {reply}")
        break
EOF
}

# Starts the agents of nodes 0..n-1 for run `run` (node names r<run>n<i>) and waits until each
# answers /readyz.
start_agents() {
    local run=$1 n=$2 i node dir addr
    for i in $(seq 0 $((n - 1))); do
        node=r${run}n$i
        dir=$WORK/agents/$node
        addr=$(node_ip "$i")
        write_agent_config "$node" "$dir" "$HOME_DIR" "$addr:$METRICS_PORT" "
[service.fanout]
listen = \"$addr:$FANOUT_PORT\"
token_file = \"$WORK/fanout.token\""
        env -u STAGEHAND_HOME -u STAGEHAND_NATS_URL ip netns exec "${TAG}n$i" \
            "$BIN/stagehand-promoter" --config "$dir/promoter.toml" 2>"$dir/stderr.log" &
        AGENT_PIDS+=($!)
    done
    for i in $(seq 0 $((n - 1))); do
        wait_ready "$(node_ip "$i"):$METRICS_PORT" "$WORK/agents/r${run}n$i/stderr.log"
    done
}

# The sum over nodes 0..n-1 of the counter stagehand_fanout_bytes_total{source="$2"}.
counted() {
    local n=$1 source=$2 i total=0 v
    for i in $(seq 0 $((n - 1))); do
        v=$(curl -sf "http://$(node_ip "$i"):$METRICS_PORT/metrics" |
            awk -v s="stagehand_fanout_bytes_total{source=\"$source\"}" '$1 == s {printf "%.0f", $2}')
        total=$((total + ${v:-0}))
    done
    echo "$total"
}

RESULTS=$WORK/results.jsonl
: >"$RESULTS"
RUN=0

# One stagehand run: N agents stage set@version at once; one JSON line.
run_stagehand() {
    local set=$1 version=$2 bytes=$3 n=$4 i node t0 t1 fail=0
    RUN=$((RUN + 1))
    purge_board
    start_agents "$RUN" "$n"
    t0=$(now)
    for i in $(seq 0 $((n - 1))); do
        "${SH[@]}" stage request "$set@$version" --tier local --node "r${RUN}n$i" \
            --job "bench-$RUN-$i" --policies "$POLICIES" >/dev/null
    done
    local waits=()
    for i in $(seq 0 $((n - 1))); do
        "${SH[@]}" stage wait "$set@$version" --tier local --node "r${RUN}n$i" \
            --job "bench-$RUN-$i" --policies "$POLICIES" --timeout 2h >"$WORK/wait-$RUN-$i" 2>&1 &
        waits+=($!)
    done
    for pid in "${waits[@]}"; do wait "$pid" || fail=1; done
    t1=$(now)
    [ "$fail" = 0 ] || { echo "bench.sh: a stage failed:" >&2; cat "$WORK"/wait-"$RUN"-* >&2; exit 1; }
    printf '{"set":"%s","nodes":%d,"tool":"stagehand","seconds":%.6f,"bytes":%d,"shared":%d,"peer":%d}\n' \
        "$set" "$n" "$(secs "$t0" "$t1")" "$bytes" "$(counted "$n" shared)" "$(counted "$n" peer)" |
        tee -a "$RESULTS"
    stop_agents
    for i in $(seq 0 $((n - 1))); do rm -rf "$HOME_DIR/tiers/local-r${RUN}n$i"; done
}

# One rclone run: N parallel `rclone copy --checksum` of the hot replica; one JSON line.
run_rclone() {
    local set=$1 hot=$2 bytes=$3 n=$4 i t0 t1
    local pids=()
    t0=$(now)
    for i in $(seq 1 "$n"); do
        rclone copy -q --checksum "$hot" "$WORK/rclone/$i" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    t1=$(now)
    printf '{"set":"%s","nodes":%d,"tool":"rclone","seconds":%.6f,"bytes":%d}\n' \
        "$set" "$n" "$(secs "$t0" "$t1")" "$bytes" | tee -a "$RESULTS"
    rm -rf "$WORK/rclone"
}

for set in $SETS; do
    src=$WORK/src-$set
    mkdir -p "$src"
    case "$set" in
    large)
        for i in $(seq "$LARGE_FILES"); do head -c $((LARGE_MIB << 20)) /dev/urandom >"$src/shard-$i.bin"; done
        bytes=$((LARGE_FILES * (LARGE_MIB << 20))) ;;
    small)
        python3 - "$src" "$SMALL_FILES" "$SMALL_BYTES" <<'EOF'
import os, sys
root, files, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pad = os.urandom(size)
for d in range(100):
    os.mkdir(f"{root}/d{d:03}")
for i in range(files):
    with open(f"{root}/d{i % 100:03}/f{i:07}.bin", "wb") as f:
        f.write((f"{i}\n".encode() + pad)[:size])
EOF
        bytes=$((SMALL_FILES * SMALL_BYTES)) ;;
    *) echo "bench.sh: SETS holds large and small, not $set" >&2; exit 1 ;;
    esac
    echo "== $set: $(find "$src" -type f | wc -l) files, $bytes bytes" >&2
    "${SH[@]}" ingest "$src" --dataset "$set" --policies "$POLICIES" --wait --timeout 3600 \
        --json >"$WORK/ingest-$set.json"
    version=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["digest"])' "$WORK/ingest-$set.json")
    "${SH[@]}" stage request "$set@$version" --tier hot --job "bench-hot-$set" --policies "$POLICIES" >/dev/null
    hot=$("${SH[@]}" stage wait "$set@$version" --tier hot --job "bench-hot-$set" --policies "$POLICIES" --timeout 2h)
    rm -rf "$src"
    for n in $NODES; do
        for _ in $(seq "$PAIRS"); do
            run_stagehand "$set" "$version" "$bytes" "$n"
            run_rclone "$set" "$hot" "$bytes" "$n"
        done
    done
done
echo "load after: $(uptime | sed 's/.*load average/load average/')"

python3 - "$RESULTS" "$PROFILE" <<'EOF'
import json, os, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"\nfan-out onto N nodes' local tiers vs N × rclone copy --checksum from hot; "
      f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} (1 min), profile {sys.argv[2]}")
print("| version | N | shared read ÷ size | from peers ÷ size | stagehand all ready | "
      "N × rclone | × rclone (median of pairs) |")
print("|---|---:|---:|---:|---:|---:|---:|")
keys = sorted({(r["set"], r["nodes"]) for r in rows}, key=lambda k: (k[0], k[1]))
for s, n in keys:
    a = [r for r in rows if (r["set"], r["nodes"], r["tool"]) == (s, n, "stagehand")]
    b = [r for r in rows if (r["set"], r["nodes"], r["tool"]) == (s, n, "rclone")]
    size = a[0]["bytes"]
    shared = st.median(r["shared"] / size for r in a)
    peer = st.median(r["peer"] / size for r in a)
    ratios = [y["seconds"] / x["seconds"] for x, y in zip(a, b)]
    label = f"{s} ({size / 2**20:.0f} MiB)"
    print(f"| {label} | {n} | {shared:.2f} (max {max(r['shared'] / size for r in a):.2f}) | "
          f"{peer:.2f} | {st.median(r['seconds'] for r in a):.2f} s | "
          f"{st.median(r['seconds'] for r in b):.2f} s | {st.median(ratios):.2f} |")
EOF
