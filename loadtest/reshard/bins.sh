# Sourced by bench.sh and stage.sh: sets BIN to the folder holding `stagehand-resharder` and
# `reshard-bench` — $BIN_DIR when given (a prebuilt pair), else built now with $PROFILE
# (release or dev) into $CARGO_TARGET_DIR. Needs REPO, PROFILE and CARGO_TARGET_DIR; $1 names
# the calling script in errors.
reshard_bins() {
    local bins=(-p stagehand-resharder -p stagehand-loadtest --bin stagehand-resharder --bin reshard-bench)
    case "${BIN_DIR:+prebuilt}${BIN_DIR:-$PROFILE}" in
    prebuilt*) BIN="$BIN_DIR" ;;
    release) (cd "$REPO" && cargo build --quiet --release "${bins[@]}"); BIN="$CARGO_TARGET_DIR/release" ;;
    dev) (cd "$REPO" && cargo build --quiet "${bins[@]}"); BIN="$CARGO_TARGET_DIR/debug" ;;
    *) echo "$1: PROFILE is release or dev, not $PROFILE" >&2; exit 1 ;;
    esac
}
