#!/usr/bin/env bash
# `stagehand status` benchmark: a catalogue with 1,000 datasets, 10,000 stages in mixed states
# across 50 projects, 500 dead letters and 20 consumers with backlog (small datasets: status
# reads no file list); `stagehand status --json` timed as a process over 50 runs.
# Targets: p99 < 1 s and under 64 MiB RSS.
#
#   loadtest/status/bench.sh
#   STAGES=50000 RUNS=20 loadtest/status/bench.sh
#
# Needs a nats-server (STAGEHAND_NATS_SERVER, or `deploy/servers.sh install`). The load
# average is printed first: other work on the machine moves every figure. PROFILE=bench-release
# builds the benchmark (and the recorder in it) optimised; the `stagehand` binary timed is the
# dev build, as in loadtest/catalogue.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
PROFILE=${PROFILE:-dev}
DIR=$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")

cd "$REPO"
cargo build --profile "$PROFILE" -p stagehand-loadtest --bin status-bench
cargo build -p stagehand --bin stagehand
"$CARGO_TARGET_DIR/$DIR/status-bench" --cli "$CARGO_TARGET_DIR/debug/stagehand" \
    --datasets "${DATASETS:-1000}" --projects "${PROJECTS:-50}" --stages "${STAGES:-10000}" \
    --dead-letters "${DEAD_LETTERS:-500}" --consumers "${CONSUMERS:-20}" --runs "${RUNS:-50}"
