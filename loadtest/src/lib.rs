//! Stagehand's load generators and benchmarks. Each benchmark is a binary under `src/bin/`
//! that measures Stagehand side by side with a raw baseline on the same machine and data, and
//! prints a table; none of them is a test.

/// CPU seconds (user and system, every thread) the process `pid` has used so far.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz)
}

/// `sync -f DIR`: one `syncfs` of the filesystem holding `dir`, so a benchmark starts from
/// data on disk rather than dirty in the page cache.
pub fn flush_filesystem(dir: &std::path::Path) -> anyhow::Result<()> {
    let synced = std::process::Command::new("sync")
        .arg("-f")
        .arg(dir)
        .status()?;
    anyhow::ensure!(synced.success(), "sync -f {}: {synced}", dir.display());
    Ok(())
}

/// The peak resident set size of the process `pid` (`VmHWM`), in bytes.
pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The machine's load average over 1, 5 and 15 minutes, as `/proc/loadavg` says it.
pub fn load_average() -> Option<String> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(
        text.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
    )
}

/// Every fact of `kind` in `project` the facts stream holds, oldest first: what happened, once
/// per fact id (the stream's duplicate window drops a second publish of an id, which a core
/// subscriber still sees: services publish an answer again when they are not sure it was
/// stored, and the promoter publishes each of its answers as it makes it and again through
/// the worker runtime).
pub async fn stored_facts(
    bus: &stagehand_bus::Bus,
    kind: &str,
    project: &str,
) -> anyhow::Result<Vec<stagehand_schemas::Event>> {
    stagehand_testkit::stored_events(
        bus.jetstream(),
        stagehand_schemas::subject::FACTS.name,
        stagehand_schemas::subject::kind_subject(stagehand_schemas::subject::FACT, kind, project),
    )
    .await
    .map_err(|e| anyhow::anyhow!("reading the {kind} facts: {e}"))
}

/// CPU seconds each live thread of the process `pid` has used so far, summed by thread name
/// with its trailing number dropped (`stagehand-hash-0` and `-1` are `stagehand-hash`,
/// io_uring's `iou-wrk-1234` workers are `iou-wrk`): where a run's CPU went, inside the
/// process. Threads that exited are not listed (the process total still counts them).
pub fn thread_cpu_seconds(pid: u32) -> std::collections::BTreeMap<String, f64> {
    let mut by_name = std::collections::BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return by_name;
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].trim_end_matches(|c: char| c.is_ascii_digit() || c == '-');
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let ticks = fields
            .get(11)
            .and_then(|u| u.parse::<f64>().ok())
            .unwrap_or(0.0)
            + fields
                .get(12)
                .and_then(|s| s.parse::<f64>().ok())
                .unwrap_or(0.0);
        *by_name.entry(name.to_owned()).or_insert(0.0) += ticks / hz;
    }
    by_name
}

/// The machine's CPU time so far, in seconds summed over every core: `(busy, idle, iowait)`
/// from `/proc/stat` (busy is user, nice, system, irq and softirq: this process, the kernel's
/// own workers such as writeback and filesystem completions, and everything else running).
pub fn machine_cpu_seconds() -> Option<(f64, f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let at = |i: usize| v.get(i).copied().unwrap_or(0.0) / hz;
    Some((at(0) + at(1) + at(2) + at(5) + at(6), at(3), at(4)))
}
