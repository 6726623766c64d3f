//! A one-node Slurm cluster for the tests that need the real one: started by
//! `deploy/slurm/slurm.sh start` (installing Slurm from the distribution when it is missing) under
//! a temp dir, stopped on drop, with its hooks calling the built `stagehand` against the test's
//! nats-server; jobs are submitted with `sbatch` as the ordinary test user (root may not use
//! burst buffers). Every wait polls Slurm (`squeue`) against a deadline; nothing sleeps.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, ensure};
use stagehand_testkit::wait_for;

use super::{Options, PROJECT, Stagehand};

/// Bound on a job getting from submit to where a test expects it.
pub const JOB: Duration = Duration::from_secs(60);
/// The prefix slurm.sh gives Slurm job ids in stage requests (STAGEHAND_JOB_PREFIX).
pub const JOB_PREFIX: &str = "slurm-stagehand-";

/// A one-node Slurm cluster under a temp dir, stopped on drop.
pub struct Slurm {
    pub dir: tempfile::TempDir,
    pub conf: PathBuf,
    pub user: String,
}

pub fn slurm_sh() -> PathBuf {
    stagehand_testkit::repo_root().join("deploy/slurm/slurm.sh")
}

pub fn said(out: &Output) -> String {
    format!(
        "exit {:?}, stdout {:?}, stderr {:?}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

impl Slurm {
    pub fn start(nats_url: &str) -> anyhow::Result<Slurm> {
        Slurm::start_with(nats_url, &[])
    }

    /// [`Slurm::start`] with more of slurm.sh's settings (`STAGEHAND_SLURM_ALLOW`, the hooks'
    /// NATS credentials, their `STAGEHAND_BIN`).
    pub fn start_with(nats_url: &str, settings: &[(&str, String)]) -> anyhow::Result<Slurm> {
        let dir = tempfile::Builder::new()
            .prefix("stagehand-slurm-")
            .tempdir()?;
        // The job user runs the TaskProlog and the jobs beneath it.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let user = "stagehand-job".to_owned();
        let out = Command::new("bash")
            .arg(slurm_sh())
            .arg("start")
            .env("STAGEHAND_SLURM_DIR", dir.path())
            .env("STAGEHAND_SLURM_USER", &user)
            .env("STAGEHAND_BIN", env!("CARGO_BIN_EXE_stagehand"))
            .env("STAGEHAND_NATS_URL", nats_url)
            .env("STAGEHAND_STAGE_IN_TIMEOUT", "120")
            .env("STAGEHAND_PROLOG_TIMEOUT", "60")
            .env("STAGEHAND_CONNECT_TIMEOUT", "2")
            .envs(settings.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .context("running deploy/slurm/slurm.sh start")?;
        let slurm = Slurm {
            conf: dir.path().join("etc/slurm.conf"),
            dir,
            user,
        };
        ensure!(
            out.status.success(),
            "deploy/slurm/slurm.sh start failed: {}",
            said(&out)
        );
        for sub in ["jobs", "out"] {
            let d = slurm.dir.path().join(sub);
            std::fs::create_dir(&d)?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755))?;
        }
        // Job output goes where the job user may write.
        let out_dir = slurm.dir.path().join("out");
        let status = Command::new("chown")
            .arg(&slurm.user)
            .arg(&out_dir)
            .status()?;
        ensure!(status.success(), "chown {}", out_dir.display());
        Ok(slurm)
    }

    pub fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `sbatch` of `script` as the test user.
    pub fn sbatch(&self, name: &str, script: &str) -> anyhow::Result<Output> {
        self.sbatch_with(name, script, &[])
    }

    /// `sbatch <options> script` as the test user.
    pub fn sbatch_with(
        &self,
        name: &str,
        script: &str,
        options: &[&str],
    ) -> anyhow::Result<Output> {
        let path = self.dir.path().join("jobs").join(format!("{name}.sh"));
        std::fs::write(&path, script)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        let out = self
            .cmd("runuser")
            .args(["-u", &self.user, "--", "env"])
            .arg(format!("SLURM_CONF={}", self.conf.display()))
            .args(["sbatch", "--parsable"])
            .arg(format!(
                "--output={}/%j.out",
                self.dir.path().join("out").display()
            ))
            .args(options)
            .arg(&path)
            .output()?;
        Ok(out)
    }

    pub fn submit(&self, name: &str, script: &str) -> anyhow::Result<u32> {
        self.submit_with(name, script, &[])
    }

    pub fn submit_with(&self, name: &str, script: &str, options: &[&str]) -> anyhow::Result<u32> {
        let out = self.sbatch_with(name, script, options)?;
        ensure!(out.status.success(), "sbatch {name}: {}", said(&out));
        let id = String::from_utf8(out.stdout)?;
        id.trim()
            .split(';')
            .next()
            .unwrap_or_default()
            .parse()
            .with_context(|| format!("sbatch printed {id:?}"))
    }

    /// The job's state and reason as squeue shows them (also for finished jobs).
    pub fn job(&self, id: u32) -> anyhow::Result<(String, String)> {
        let out = self
            .cmd("squeue")
            .args(["-h", "-t", "all", "-j", &id.to_string(), "-o", "%T|%r"])
            .output()?;
        ensure!(out.status.success(), "squeue: {}", said(&out));
        let text = String::from_utf8(out.stdout)?;
        let (state, reason) = text.trim().split_once('|').unwrap_or((text.trim(), ""));
        Ok((state.to_owned(), reason.to_owned()))
    }

    /// Waits until the job's (state, reason) satisfies `pred`; returns it.
    pub async fn wait_job(
        &self,
        id: u32,
        what: &str,
        pred: impl Fn(&str, &str) -> bool,
    ) -> anyhow::Result<(String, String)> {
        let mut last = (String::new(), String::new());
        let found = wait_for(JOB, what, || {
            let seen = self.job(id);
            let hit = match &seen {
                Ok((s, r)) => pred(s, r).then(|| (s.clone(), r.clone())),
                Err(_) => None,
            };
            if let Ok(s) = seen {
                last = s;
            }
            async move { hit }
        })
        .await;
        found.map_err(|e| anyhow::anyhow!("job {id}: {e}; last seen {last:?}; {}", self.logs()))
    }

    /// `scontrol show job` of the job.
    pub fn show_job(&self, id: u32) -> anyhow::Result<String> {
        let out = self
            .cmd("scontrol")
            .args(["show", "job", &id.to_string()])
            .output()?;
        ensure!(
            out.status.success(),
            "scontrol show job {id}: {}",
            said(&out)
        );
        Ok(String::from_utf8(out.stdout)?)
    }

    pub fn output(&self, id: u32) -> anyhow::Result<String> {
        let path = self.dir.path().join("out").join(format!("{id}.out"));
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    }

    pub fn logs(&self) -> String {
        let tail = |name: &str| {
            let text =
                std::fs::read_to_string(self.dir.path().join("log").join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(15)..].join("\n")
        };
        // The hooks' own lines, however far back: where a stage-in waited and why.
        let hooks = std::fs::read_to_string(self.dir.path().join("log").join("slurmctld.log"))
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains("stagehand:"))
            .collect::<Vec<_>>()
            .join("\n");
        format!(
            "the hooks' lines in slurmctld.log:\n{hooks}\nslurmctld.log:\n{}\nslurmd.log:\n{}",
            tail("slurmctld.log"),
            tail("slurmd.log")
        )
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(slurm_sh())
            .arg("stop")
            .env("STAGEHAND_SLURM_DIR", self.dir.path())
            .output();
    }
}

/// Stagehand and a Slurm cluster whose hooks talk to it, the cluster starting while the
/// services do.
pub async fn setup(opts: Options) -> anyhow::Result<(Stagehand, Slurm)> {
    setup_with(opts, Vec::new()).await
}

/// [`setup`] with more of slurm.sh's settings ([`Slurm::start_with`]).
pub async fn setup_with(
    opts: Options,
    settings: Vec<(&'static str, String)>,
) -> anyhow::Result<(Stagehand, Slurm)> {
    let server = stagehand_testkit::NatsServer::start();
    let url = server.url();
    // Slurm first: slurm.sh makes the job user, whose group is the project's (staged data is
    // readable by the project's group only), and the services look the group up at start.
    let slurm = tokio::task::spawn_blocking(move || Slurm::start_with(&url, &settings)).await??;
    let opts = Options {
        job_groups: vec![(PROJECT.to_owned(), slurm.user.clone())],
        ..opts
    };
    let stagehand = Stagehand::start_on(server, opts).await?;
    Ok((stagehand, slurm))
}
