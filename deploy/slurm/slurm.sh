#!/usr/bin/env bash
# A one-machine Slurm cluster with Stagehand's burst buffer, node hooks and a test user: what the
# Slurm tests run against, and what a developer uses to try the walk-through in README.md.
#
#   deploy/slurm/slurm.sh install   Slurm and MUNGE from the distribution (apt-get install -y
#                                   slurm-wlm munge); nothing else of the machine is configured
#   deploy/slurm/slurm.sh start     write the configuration under $STAGEHAND_SLURM_DIR, start
#                                   munged, slurmctld and slurmd (no systemd), create the test
#                                   user, and wait until the node is idle
#   deploy/slurm/slurm.sh stop      stop the three daemons started from $STAGEHAND_SLURM_DIR
#   deploy/slurm/slurm.sh restart-controller
#                                   stop slurmctld and start it again on the same state (what
#                                   an upgrade or a crash does; the hooks must be idempotent)
#   deploy/slurm/slurm.sh status    what runs, and the node's state
#   deploy/slurm/slurm.sh env       `export` lines for clients: eval "$(deploy/slurm/slurm.sh env)"
#
# Everything lives under $STAGEHAND_SLURM_DIR (default <repo>/.stagehand/slurm): its own
# slurm.conf (clients find it through SLURM_CONF), MUNGE key and socket, state, spool, logs,
# and the Stagehand hooks copied from this folder. The system's /etc/slurm and /etc/munge are not
# touched, so the cluster can run beside a real one. Must run as root (slurmd starts jobs as
# their users).
#
# Settings (environment), written into stagehand-slurm.conf for the hooks:
#   STAGEHAND_SLURM_DIR        where the cluster lives (created; parents must be searchable by
#                              the test user, which runs the TaskProlog and the jobs)
#   STAGEHAND_SLURM_USER       the ordinary user test jobs run as (root may not use burst
#                              buffers); created when missing. Default stagehand-job
#   STAGEHAND_BIN              the stagehand CLI the hooks call. Default: `stagehand` on PATH
#   STAGEHAND_NATS_URL         NATS server(s) the hooks' CLI talks to. Default nats://127.0.0.1:4222
#   STAGEHAND_NATS_PASSWORD_FILE  a file (mode 0600) holding the password of the user
#                              STAGEHAND_NATS_URL names (nats://scheduler@host:4222); or
#   STAGEHAND_NATS_CREDS       a .creds file for the hooks' NATS user (optional)
#   STAGEHAND_NATS_TLS_CA      the CA bundle of the servers' TLS certificates (optional)
#   STAGEHAND_SLURM_ALLOW      who may stage which project: `allow` rules of
#                              stagehand-slurm.conf separated by ';', e.g.
#                              "account=demo demo;user=alice demo,labb". Default: the test
#                              user may stage ${STAGEHAND_PROJECT:-lab} (the walk-through's project)
#   STAGEHAND_PROJECT          project of directives that name none (optional)
#   STAGEHAND_STAGE_IN_TIMEOUT seconds a job may wait for its data (burst_buffer.conf
#                              StageInTimeout; also the bound of 22.05's waiting data_in).
#                              Default 3600
#   STAGEHAND_PROLOG_TIMEOUT   seconds the Prolog waits for node-local data. Default 600
#   STAGEHAND_STATUS_EVERY     seconds between notes of a waiting stage in the job's
#                              AdminComment. Default 30
#   STAGEHAND_CONNECT_TIMEOUT  seconds each hook's CLI call tries to reach NATS. Default 10
#   STAGEHAND_POOL_TIERS       tiers reported to Slurm as pools (optional); their figures are
#                              read from $STAGEHAND_SLURM_DIR/stagehand/pools
#   STAGEHAND_SLURM_START_TIMEOUT  seconds to wait for the node to become idle. Default 30
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${STAGEHAND_SLURM_DIR:-$REPO/.stagehand/slurm}"
JOB_USER="${STAGEHAND_SLURM_USER:-stagehand-job}"
START_TIMEOUT="${STAGEHAND_SLURM_START_TIMEOUT:-30}"
NODE="$(hostname -s)"

log() { printf 'slurm.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() {
    [ "$(id -u)" -eq 0 ] || die "$1 needs root (slurmd starts jobs as their users); run it with sudo"
}

installed() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null &&
        [ -e "$(plugin_dir)/burst_buffer_lua.so" ]
}

plugin_dir() {
    local d
    for d in /usr/lib/x86_64-linux-gnu/slurm-wlm /usr/lib/aarch64-linux-gnu/slurm-wlm \
        /usr/lib64/slurm /usr/lib/slurm; do
        if [ -e "$d/burst_buffer_lua.so" ]; then
            echo "$d"
            return
        fi
    done
    echo /usr/lib/x86_64-linux-gnu/slurm-wlm
}

cmd_install() {
    if installed; then
        log "Slurm $(slurmctld -V | cut -d' ' -f2) and MUNGE already installed"
        return
    fi
    need_root install
    command -v apt-get >/dev/null ||
        die "apt-get not found; install Slurm (with burst_buffer/lua) and MUNGE with your package manager"
    # Tests start clusters in parallel: one installs, the others wait for it.
    exec 9>/tmp/stagehand-slurm-install.lock
    flock 9
    if ! installed; then
        log "installing slurm-wlm and munge (about a minute)"
        apt-get update -qq || die "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null ||
            die "apt-get install -y slurm-wlm munge failed"
    fi
    flock -u 9
    installed || die "slurm-wlm installed, but burst_buffer_lua.so or a daemon is missing"
    log "installed Slurm $(slurmctld -V | cut -d' ' -f2)"
}

# Whether the installed Slurm is at least MAJOR.MINOR (e.g. 24 5).
version_at_least() {
    local v major minor
    v="$(slurmctld -V | cut -d' ' -f2)"
    major="${v%%.*}"
    minor="${v#*.}"
    minor="${minor%%.*}"
    [ "$major" -gt "$1" ] || { [ "$major" -eq "$1" ] && [ "$((10#$minor))" -ge "$2" ]; }
}

# A TCP port nothing listens on, from a range the kernel does not hand out as ephemeral.
free_port() {
    local port tries=0
    while [ "$tries" -lt 200 ]; do
        port=$((20000 + RANDOM % 12000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return
        fi
        tries=$((tries + 1))
    done
    die "no free TCP port found"
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Starts "$@" detached in its own session, output to $log, pid to $pidfile.
spawn() {
    local pidfile="$1" logfile="$2"
    shift 2
    setsid "$@" >>"$logfile" 2>&1 </dev/null &
    echo $! >"$pidfile"
}

# Writes the configuration, substituting the cluster's paths, ports and node.
write_config() {
    local etc="$DIR/etc" ctld_port slurmd_port stagehand_bin
    ctld_port="$(free_port)"
    slurmd_port="$(free_port)"
    [ "$ctld_port" != "$slurmd_port" ] || slurmd_port="$(free_port)"
    stagehand_bin="${STAGEHAND_BIN:-$(command -v stagehand || true)}"
    [ -n "$stagehand_bin" ] || log "warning: no stagehand on PATH and STAGEHAND_BIN unset; hooks will fail"

    cat >"$etc/slurm.conf" <<EOF
# Written by deploy/slurm/slurm.sh: a one-node cluster for Stagehand's tests.
ClusterName=stagehand
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
KillWait=5
MinJobAge=600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    sed -e "s|@ETC@|$etc|g" "$HERE/slurm.conf.fragment" >>"$etc/slurm.conf"
    sed -e "s|^StageInTimeout=.*|StageInTimeout=${STAGEHAND_STAGE_IN_TIMEOUT:-3600}|" \
        "$HERE/burst_buffer.conf" >"$etc/burst_buffer.conf"
    if version_at_least 24 5; then
        echo "PollInterval=1" >>"$etc/burst_buffer.conf"
    fi
    install -m 0644 "$HERE/burst_buffer.lua" "$etc/burst_buffer.lua"
    install -m 0644 "$HERE/job_submit.lua" "$etc/job_submit.lua"
    install -m 0644 "$HERE/stagehand_slurm.lua" "$etc/stagehand_slurm.lua"
    install -m 0755 "$HERE/stagehand-node.sh" "$etc/stagehand-node.sh"
    # The shipped template with this cluster's values.
    sed -e "s|^STAGEHAND_BIN=.*|STAGEHAND_BIN=$stagehand_bin|" \
        -e "s|^STAGEHAND_NATS_URL=.*|STAGEHAND_NATS_URL=${STAGEHAND_NATS_URL:-nats://127.0.0.1:4222}|" \
        -e "s|^STAGEHAND_NATS_CREDS=.*|STAGEHAND_NATS_CREDS=${STAGEHAND_NATS_CREDS:-}|" \
        -e "s|^STAGEHAND_NATS_NKEY=.*|STAGEHAND_NATS_NKEY=${STAGEHAND_NATS_NKEY:-}|" \
        -e "s|^STAGEHAND_NATS_PASSWORD_FILE=.*|STAGEHAND_NATS_PASSWORD_FILE=${STAGEHAND_NATS_PASSWORD_FILE:-}|" \
        -e "s|^STAGEHAND_NATS_TLS_CA=.*|STAGEHAND_NATS_TLS_CA=${STAGEHAND_NATS_TLS_CA:-}|" \
        -e "s|^STAGEHAND_PROJECT=.*|STAGEHAND_PROJECT=${STAGEHAND_PROJECT:-}|" \
        -e "s|^STAGEHAND_JOB_PREFIX=.*|STAGEHAND_JOB_PREFIX=slurm-stagehand-|" \
        -e "s|^STAGEHAND_STATE_DIR=.*|STAGEHAND_STATE_DIR=$DIR/stagehand|" \
        -e "s|^STAGEHAND_CONNECT_TIMEOUT=.*|STAGEHAND_CONNECT_TIMEOUT=${STAGEHAND_CONNECT_TIMEOUT:-10}|" \
        -e "s|^STAGEHAND_STAGE_TIMEOUT=.*|STAGEHAND_STAGE_TIMEOUT=${STAGEHAND_STAGE_IN_TIMEOUT:-3600}|" \
        -e "s|^STAGEHAND_STATUS_EVERY=.*|STAGEHAND_STATUS_EVERY=${STAGEHAND_STATUS_EVERY:-30}|" \
        -e "s|^STAGEHAND_PROLOG_TIMEOUT=.*|STAGEHAND_PROLOG_TIMEOUT=${STAGEHAND_PROLOG_TIMEOUT:-600}|" \
        -e "s|^STAGEHAND_POOL_TIERS=.*|STAGEHAND_POOL_TIERS=${STAGEHAND_POOL_TIERS:-}|" \
        -e "s|^STAGEHAND_POOL_FILE=.*|STAGEHAND_POOL_FILE=$DIR/stagehand/pools|" \
        "$HERE/stagehand-slurm.conf" >"$etc/stagehand-slurm.conf"
    local rule rules allow="${STAGEHAND_SLURM_ALLOW-user=$JOB_USER ${STAGEHAND_PROJECT:-lab}}"
    {
        echo "# Written by slurm.sh from STAGEHAND_SLURM_ALLOW."
        IFS=';' read -ra rules <<<"$allow"
        for rule in ${rules[@]+"${rules[@]}"}; do
            [ -z "${rule// /}" ] || echo "allow $rule"
        done
    } >>"$etc/stagehand-slurm.conf"
    chmod 0644 "$etc/stagehand-slurm.conf"
}

ensure_user() {
    if ! id -u "$JOB_USER" >/dev/null 2>&1; then
        # Two clusters starting at once may race to create it: the loser finds it made.
        if useradd --create-home --user-group --shell /bin/bash "$JOB_USER" 2>/dev/null; then
            log "created user $JOB_USER for test jobs"
        fi
        id -u "$JOB_USER" >/dev/null 2>&1 || die "cannot create user $JOB_USER"
    fi
}

wait_idle() {
    local deadline=$((SECONDS + START_TIMEOUT)) state=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        state="$(SLURM_CONF="$DIR/etc/slurm.conf" sinfo -h -n "$NODE" -o %T 2>/dev/null || true)"
        case "$state" in
        idle | mixed | allocated) return 0 ;;
        esac
        for p in munged slurmctld slurmd; do
            running "$DIR/run/$p.pid" || die "$p exited; see $DIR/log/$p.log: $(tail -n 3 "$DIR/log/$p.log" 2>/dev/null | tr '\n' ' ')"
        done
        sleep 0.2
    done
    die "node $NODE not idle after ${START_TIMEOUT}s (state: ${state:-none}); see $DIR/log"
}

cmd_start() {
    need_root start
    installed || cmd_install
    if running "$DIR/run/slurmctld.pid"; then
        log "already running from $DIR"
        return
    fi
    mkdir -p "$DIR"/{etc,state,spool,log,run,munge,stagehand}
    chmod 0755 "$DIR" "$DIR/etc" "$DIR/stagehand"
    chmod 0700 "$DIR/munge"
    ensure_user
    write_config

    if [ ! -s "$DIR/munge/munge.key" ]; then
        head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
        chmod 0400 "$DIR/munge/munge.key"
    fi
    # A start that fails part-way stops what it started.
    trap cmd_stop EXIT
    spawn "$DIR/run/munged.pid" "$DIR/log/munged.log" \
        munged --foreground --force --socket="$DIR/munge/munge.socket.2" \
        --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
        --seed-file="$DIR/munge/munged.seed" --log-file="$DIR/log/munged.log"
    local deadline=$((SECONDS + 10))
    until [ -S "$DIR/munge/munge.socket.2" ]; do
        running "$DIR/run/munged.pid" || die "munged exited: $(tail -n 3 "$DIR/log/munged.log")"
        [ "$SECONDS" -lt "$deadline" ] || die "munged socket did not appear"
        sleep 0.1
    done
    # The socket's directory must let the job user's clients (sbatch) reach it.
    chmod 0755 "$DIR/munge"

    export SLURM_CONF="$DIR/etc/slurm.conf"
    spawn "$DIR/run/slurmctld.pid" "$DIR/log/slurmctld.out" slurmctld -D -i -f "$SLURM_CONF"
    spawn "$DIR/run/slurmd.pid" "$DIR/log/slurmd.out" slurmd -D -f "$SLURM_CONF" -N "$NODE"
    wait_idle
    trap - EXIT
    log "Slurm $(slurmctld -V | cut -d' ' -f2) up: node $NODE idle, SLURM_CONF=$SLURM_CONF, test user $JOB_USER"
}

cmd_stop() {
    # All three at once: each takes a second or two to shut down.
    local name pid pids=()
    for name in slurmd slurmctld munged; do
        if running "$DIR/run/$name.pid"; then
            pid="$(cat "$DIR/run/$name.pid")"
            kill -TERM "$pid" 2>/dev/null && pids+=("$name:$pid")
        fi
    done
    local deadline=$((SECONDS + 10)) entry
    for entry in ${pids[@]+"${pids[@]}"}; do
        name="${entry%%:*}"
        pid="${entry#*:}"
        while kill -0 "$pid" 2>/dev/null; do
            if [ "$SECONDS" -ge "$deadline" ]; then
                log "$name did not stop in 10 s; killing it"
                kill -KILL "$pid" 2>/dev/null || true
            fi
            sleep 0.05
        done
        rm -f "$DIR/run/$name.pid"
    done
    log "stopped the cluster of $DIR"
}

cmd_restart_controller() {
    need_root restart-controller
    running "$DIR/run/slurmctld.pid" || die "slurmctld of $DIR is not running"
    local pid
    pid="$(cat "$DIR/run/slurmctld.pid")"
    kill -TERM "$pid"
    local deadline=$((SECONDS + 10))
    while kill -0 "$pid" 2>/dev/null; do
        [ "$SECONDS" -lt "$deadline" ] || kill -KILL "$pid" 2>/dev/null || true
        sleep 0.05
    done
    export SLURM_CONF="$DIR/etc/slurm.conf"
    spawn "$DIR/run/slurmctld.pid" "$DIR/log/slurmctld.out" slurmctld -D -i -f "$SLURM_CONF"
    wait_idle
    log "slurmctld restarted"
}

cmd_status() {
    for p in munged slurmctld slurmd; do
        if running "$DIR/run/$p.pid"; then
            echo "$p: running (pid $(cat "$DIR/run/$p.pid"))"
        else
            echo "$p: stopped"
        fi
    done
    if running "$DIR/run/slurmctld.pid"; then
        SLURM_CONF="$DIR/etc/slurm.conf" sinfo -N -o '%N %T' || true
    fi
}

cmd_env() {
    echo "export SLURM_CONF=$DIR/etc/slurm.conf"
    echo "export STAGEHAND_SLURM_USER=$JOB_USER"
}

case "${1:-}" in
install) cmd_install ;;
start) cmd_start ;;
stop) cmd_stop ;;
restart-controller) cmd_restart_controller ;;
status) cmd_status ;;
env) cmd_env ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 64
    ;;
esac
