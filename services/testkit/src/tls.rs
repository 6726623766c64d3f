//! A real certificate chain for TLS tests, made with Debian's `openssl`: a CA, and server
//! certificates it signs for `localhost` and `127.0.0.1` (usable for client and route
//! listeners: they carry both `serverAuth` and `clientAuth`), in a folder of their own.
//!
//! The files are named as the deploy layout names them (deploy/README.md, *TLS*): `ca.pem`,
//! `server.pem`, `server-key.pem`, so a shipped configuration runs against them with only its
//! folder changed.

use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

/// A CA and one server certificate it signed, in a temporary folder removed on drop.
#[derive(Debug)]
pub struct TestCa {
    dir: TempDir,
}

/// Runs `openssl` with `args` in `dir`; panics with its output when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("running openssl (apt-get install openssl): {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestCa {
    /// A new CA named `name`, and `server.pem` / `server-key.pem` signed by it for
    /// `localhost` and `127.0.0.1`.
    pub fn new(name: &str) -> TestCa {
        let dir = tempfile::Builder::new()
            .prefix("stagehand-tls-")
            .tempdir()
            .expect("create a temp dir for certificates");
        let p = dir.path();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        let subject = format!("/CN={name}");
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend([
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            &subject,
        ]);
        openssl(p, &ca);
        let mut csr = vec!["req"];
        csr.extend(ec);
        csr.extend([
            "-keyout",
            "server-key.pem",
            "-out",
            "server.csr",
            "-subj",
            "/CN=stagehand-nats",
        ]);
        openssl(p, &csr);
        std::fs::write(
            p.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n\
             extendedKeyUsage=serverAuth,clientAuth\n\
             basicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\n",
        )
        .expect("write the certificate extensions");
        openssl(
            p,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca-key.pem",
                "-CAcreateserial",
                "-out",
                "server.pem",
                "-days",
                "2",
                "-extfile",
                "server.ext",
            ],
        );
        TestCa { dir }
    }

    /// The folder holding `ca.pem`, `server.pem` and `server-key.pem`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The server certificate (PEM), for `localhost` and `127.0.0.1`.
    pub fn server_cert(&self) -> PathBuf {
        self.dir.path().join("server.pem")
    }

    /// The server certificate's private key (PEM).
    pub fn server_key(&self) -> PathBuf {
        self.dir.path().join("server-key.pem")
    }
}

/// Where the shipped NATS configurations expect their certificates (deploy/README.md, *TLS*).
pub const DEPLOY_TLS_DIR: &str = "/etc/stagehand/nats/";

impl TestCa {
    /// The shipped `deploy/nats/<name>` as a test server runs it: its certificates this CA's
    /// (the deploy folder [`DEPLOY_TLS_DIR`] replaced by [`TestCa::dir`]) and its `include
    /// ./accounts.conf` replaced by the shipped file's text (nats-server resolves an include
    /// beside the including file, and a test writes the text elsewhere), and without its
    /// JetStream `store_dir` (the testkit gives every server its own, `-sd`, which the server
    /// refuses next to one in the file).
    /// Panics when the file names no certificate to replace, so a shipped config that lost its
    /// TLS cannot pass a TLS test.
    pub fn shipped_nats_config(&self, name: &str) -> String {
        let accounts_path = crate::accounts_conf();
        let accounts = std::fs::read_to_string(&accounts_path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", accounts_path.display()));
        self.shipped_nats_config_with_accounts(name, &accounts)
    }

    /// [`TestCa::shipped_nats_config`] with `accounts` (such as
    /// [`crate::accounts_conf_with_projects`]) in place of the shipped accounts config.
    pub fn shipped_nats_config_with_accounts(&self, name: &str, accounts: &str) -> String {
        let path = crate::repo_root().join("deploy/nats").join(name);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        assert!(
            text.contains(DEPLOY_TLS_DIR),
            "{} names no certificate under {DEPLOY_TLS_DIR}",
            path.display()
        );
        let dir = format!("{}/", self.dir().display());
        text.lines()
            .filter(|l| !l.trim_start().starts_with("store_dir:"))
            .collect::<Vec<_>>()
            .join("\n")
            .replace(DEPLOY_TLS_DIR, &dir)
            .replace("include ./accounts.conf", accounts)
    }
}
