//! What a rejection found, in memory bounded by a constant however many problems there are.
//!
//! Every problem goes two ways as it is found: into a [`ProblemTally`] (the first problems
//! that fit an event, and a count per code of all of them), which becomes the rejection
//! event; and, line by line, into the *quarantine report*, a JSON-lines file spooled on a
//! local disk while the request is validated and then put on the source tier with the mover
//! beside the upload ([`report_path`]). Nothing of the report is kept in memory.
//!
//! The report's lines, each a JSON object with a `kind`:
//!
//! ```text
//! {"kind":"request","request_id":"…","project":"…","dataset":"…","requested_by":"…","source":{"tier":"…","prefix":"…"},"declared_version":"…"}
//! {"kind":"problem","code":"missing","path":"img/1.png","detail":"no file at this path on the source tier"}
//! …one line per problem, request-wide ones first, then per entry in path order…
//! {"kind":"summary","problems_total":20000,"problem_counts":[["missing",20000]]}
//! ```
//!
//! The bytes follow from the request and what was found alone (no clock, no host), so a
//! redelivered request writes the same report and the mover finds it already in place.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use sha2::{Digest, Sha256};
use stagehand_mover::{PosixTier, Tier};
use stagehand_schemas::problem::ProblemTally;
use stagehand_schemas::{EventId, FileRef, Location, Problem};

/// The folder beneath a source tier's root that holds the validator's reports.
pub const QUARANTINE_DIR: &str = ".stagehand/quarantine";

/// Where a rejected request's report goes, beneath the source tier root.
pub fn report_path(project: &str, request: &EventId) -> String {
    format!("{QUARANTINE_DIR}/{project}/{request}.jsonl")
}

/// The request a report is about: its first line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReportHeader {
    pub request_id: EventId,
    pub project: String,
    pub dataset: String,
    pub requested_by: String,
    pub source: Location,
    pub declared_version: String,
}

#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Line<'a> {
    Request(&'a ReportHeader),
    Problem(&'a Problem),
    Summary {
        problems_total: u64,
        problem_counts: &'a [(String, u64)],
    },
}

/// Why a report could not be spooled (a full or failing local disk): retryable.
#[derive(Debug, thiserror::Error)]
#[error("spooling the quarantine report in {}: {source}", dir.display())]
pub struct ReportError {
    pub dir: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// The problems found so far: tallied for the event, streamed into the report.
#[derive(Debug)]
pub struct Findings {
    header: ReportHeader,
    tally: ProblemTally,
    /// Where reports are spooled; `None` keeps the tally only (no tier to put a report on).
    spool: Option<PathBuf>,
    /// Opened at the first problem: most requests have none.
    writer: Option<ReportWriter>,
}

impl Findings {
    /// Findings about the request `header` names; reports are spooled in `spool` (`None`:
    /// tally only).
    pub fn new(header: ReportHeader, spool: Option<PathBuf>) -> Findings {
        Findings {
            header,
            tally: ProblemTally::new(),
            spool,
            writer: None,
        }
    }

    /// Adds one problem.
    pub fn add(&mut self, problem: Problem) -> Result<(), ReportError> {
        if let Some(dir) = &self.spool {
            if self.writer.is_none() {
                let mut writer = ReportWriter::create(
                    dir,
                    &report_path(&self.header.project, &self.header.request_id),
                )?;
                writer.line(&Line::Request(&self.header))?;
                self.writer = Some(writer);
            }
            if let Some(writer) = &mut self.writer {
                writer.line(&Line::Problem(&problem))?;
            }
        }
        self.tally.add(problem);
        Ok(())
    }

    /// Whether no problem was found.
    pub fn is_empty(&self) -> bool {
        self.tally.is_empty()
    }

    /// Problems found so far.
    pub fn total(&self) -> u64 {
        self.tally.total()
    }

    pub fn header(&self) -> &ReportHeader {
        &self.header
    }

    /// Ends the report: the event's share of the problems and the spooled report, when
    /// there is one.
    pub fn finish(self) -> Result<(Tallied, Option<SpooledReport>), ReportError> {
        let (listed, counts, total) = self.tally.finish();
        let report = match self.writer {
            Some(mut writer) => {
                writer.line(&Line::Summary {
                    problems_total: total,
                    problem_counts: &counts,
                })?;
                Some(writer.finish()?)
            }
            None => None,
        };
        Ok((
            Tallied {
                listed,
                counts,
                total,
            },
            report,
        ))
    }
}

/// The problems as a rejection event carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tallied {
    /// The first problems that fit the event bound, ending with `truncated` when cut.
    pub listed: Vec<Problem>,
    /// Count per code of every problem, sorted by code.
    pub counts: Vec<(String, u64)>,
    pub total: u64,
}

/// A report being written: JSON lines into a file in its own temporary directory, hashed on
/// the way for the mover's proof.
#[derive(Debug)]
struct ReportWriter {
    dir: tempfile::TempDir,
    rel: String,
    out: BufWriter<File>,
    hasher: Sha256,
    len: u64,
}

impl ReportWriter {
    fn create(spool: &Path, rel: &str) -> Result<ReportWriter, ReportError> {
        let err = |source| ReportError {
            dir: spool.to_owned(),
            source,
        };
        let dir = tempfile::Builder::new()
            .prefix("report-")
            .tempdir_in(spool)
            .map_err(err)?;
        let path = dir.path().join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(err)?;
        }
        let file = File::create_new(&path).map_err(err)?;
        Ok(ReportWriter {
            dir,
            rel: rel.to_owned(),
            out: BufWriter::with_capacity(64 * 1024, file),
            hasher: Sha256::new(),
            len: 0,
        })
    }

    fn err(&self, source: std::io::Error) -> ReportError {
        ReportError {
            dir: self.dir.path().to_owned(),
            source,
        }
    }

    fn line(&mut self, line: &Line<'_>) -> Result<(), ReportError> {
        let mut bytes = serde_json::to_vec(line).map_err(|e| self.err(e.into()))?;
        bytes.push(b'\n');
        self.hasher.update(&bytes);
        self.len += bytes.len() as u64;
        self.out.write_all(&bytes).map_err(|e| self.err(e))
    }

    fn finish(self) -> Result<SpooledReport, ReportError> {
        let ReportWriter {
            dir,
            rel,
            out,
            hasher,
            len,
        } = self;
        let err = |source| ReportError {
            dir: dir.path().to_owned(),
            source,
        };
        out.into_inner().map_err(|e| err(e.into_error()))?;
        let tier = PosixTier::open("quarantine-spool", dir.path())
            .map_err(|e| err(std::io::Error::other(e)))?;
        Ok(SpooledReport {
            local: dir.path().join(&rel),
            file: FileRef::new(rel, len, hex::encode(hasher.finalize())),
            tier: Tier::Posix(tier),
            _dir: dir,
        })
    }
}

/// A finished report on the local spool, ready to be put on a tier: a one-file posix tier
/// and the file's reference (path, size, SHA-256) for the mover. The spool is removed when
/// this is dropped.
#[derive(Debug)]
pub struct SpooledReport {
    file: FileRef,
    tier: Tier,
    local: PathBuf,
    _dir: tempfile::TempDir,
}

impl SpooledReport {
    /// The path the report takes on the source tier ([`report_path`]).
    pub fn rel(&self) -> &str {
        &self.file.path
    }

    /// The report's path, size and SHA-256.
    pub fn file(&self) -> &FileRef {
        &self.file
    }

    /// The spool as a tier holding the report at [`SpooledReport::rel`].
    pub fn tier(&self) -> &Tier {
        &self.tier
    }

    /// Reads the spooled report whole (tests and small fakes; the service copies it with
    /// the mover).
    pub fn read(&self) -> std::io::Result<Vec<u8>> {
        std::fs::read(&self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::problem::code;

    fn header() -> ReportHeader {
        ReportHeader {
            request_id: EventId::new("req-1").unwrap(),
            project: "lab".into(),
            dataset: "d".into(),
            requested_by: "alice".into(),
            source: Location {
                tier: "source".into(),
                prefix: "lab/d".into(),
            },
            declared_version: "0".repeat(64),
        }
    }

    #[test]
    fn every_problem_is_in_the_report_and_the_event_gets_a_bounded_share() {
        let spool = tempfile::tempdir().unwrap();
        let mut findings = Findings::new(header(), Some(spool.path().to_owned()));
        for i in 0..5000 {
            findings
                .add(Problem::new(
                    code::MISSING,
                    Some(&format!("f{i:05}")),
                    "gone",
                ))
                .unwrap();
        }
        let (tallied, report) = findings.finish().unwrap();
        assert_eq!(tallied.total, 5000);
        assert_eq!(tallied.counts, vec![("missing".to_owned(), 5000)]);
        assert_eq!(tallied.listed.last().unwrap().code, code::TRUNCATED);
        let report = report.unwrap();
        assert_eq!(report.rel(), ".stagehand/quarantine/lab/req-1.jsonl");
        let bytes = report.read().unwrap();
        assert_eq!(report.file().size, bytes.len() as u64);
        assert_eq!(report.file().sha256, stagehand_schemas::sha256_hex(&bytes));
        let lines: Vec<serde_json::Value> = bytes
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 5002);
        assert_eq!(lines[0]["kind"], "request");
        assert_eq!(lines[0]["request_id"], "req-1");
        assert_eq!(lines[1]["kind"], "problem");
        assert_eq!(lines[1]["path"], "f00000");
        assert_eq!(lines[5000]["path"], "f04999");
        assert_eq!(lines[5001]["kind"], "summary");
        assert_eq!(lines[5001]["problems_total"], 5000);
        // The spool goes with the report.
        let dir = report.tier().clone();
        drop(report);
        let Tier::Posix(dir) = dir else {
            unreachable!()
        };
        assert!(!dir.root().exists());
    }

    #[test]
    fn no_problem_writes_no_report() {
        let spool = tempfile::tempdir().unwrap();
        let findings = Findings::new(header(), Some(spool.path().to_owned()));
        assert!(findings.is_empty());
        let (tallied, report) = findings.finish().unwrap();
        assert_eq!(tallied.total, 0);
        assert!(report.is_none());
        assert_eq!(std::fs::read_dir(spool.path()).unwrap().count(), 0);
    }
}
