//! TLS between agents (`[service.fanout.tls]`): every agent presents a certificate signed by
//! the cluster's agent CA, as server and as client, and accepts only peers that do — mutual
//! TLS, with every request still signed with the agents' secret inside it. One certificate may serve every
//! agent (the name it carries given as `server_name`), since agents are dialed by address.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::Deserialize;

use super::FanoutError;

/// `[service.fanout.tls]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FanoutTls {
    /// This agent's certificate chain (PEM), signed by `ca_file`'s CA.
    pub cert_file: PathBuf,
    /// Its private key (PEM), readable by the agent's user only.
    pub key_file: PathBuf,
    /// The agents' CA (PEM): the only issuer of a peer's certificate this agent accepts.
    pub ca_file: PathBuf,
    /// The name peers' certificates carry (`"stagehand-agent"`); default: the host of the
    /// address dialed.
    #[serde(default)]
    pub server_name: Option<String>,
}

/// Both ends of TLS between agents.
#[derive(Clone)]
pub struct AgentTls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub connector: tokio_rustls::TlsConnector,
    server_name: Option<ServerName<'static>>,
}

fn bad(path: &Path, why: impl std::fmt::Display) -> FanoutError {
    FanoutError::Config(format!("tls: {}: {why}", path.display()))
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, FanoutError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(path, e))?;
    if certs.is_empty() {
        return Err(bad(path, "holds no certificate"));
    }
    Ok(certs)
}

impl FanoutTls {
    /// Loads the files and builds both ends.
    pub fn load(&self) -> Result<AgentTls, FanoutError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in certificates(&self.ca_file)? {
            roots.add(cert).map_err(|e| bad(&self.ca_file, e))?;
        }
        let roots = Arc::new(roots);
        let chain = certificates(&self.cert_file)?;
        let key =
            PrivateKeyDer::from_pem_file(&self.key_file).map_err(|e| bad(&self.key_file, e))?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| bad(&self.ca_file, e))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(&self.cert_file, e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| bad(&self.cert_file, e))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(&self.cert_file, e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| bad(&self.cert_file, e))?;
        let server_name = match &self.server_name {
            None => None,
            Some(n) => Some(
                ServerName::try_from(n.clone())
                    .map_err(|e| FanoutError::Config(format!("tls: server_name {n:?}: {e}")))?,
            ),
        };
        Ok(AgentTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
            connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
            server_name,
        })
    }
}

impl AgentTls {
    /// The name a peer dialed at `addr` (`host:port`) must prove.
    pub fn name_for(&self, addr: &str) -> Result<ServerName<'static>, String> {
        if let Some(n) = &self.server_name {
            return Ok(n.clone());
        }
        let host = addr
            .rsplit_once(':')
            .map_or(addr, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        ServerName::try_from(host.to_owned()).map_err(|e| format!("{host:?}: {e}"))
    }
}
