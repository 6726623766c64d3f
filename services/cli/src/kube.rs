//! The few Kubernetes API calls `stagehand k8s gates` makes: list the gated pods, patch one.
//! HTTP/1.1 over hyper (and rustls for https), one connection per call, no Kubernetes client
//! library: `kube` and `k8s-openapi` would double the CLI's build for two calls. In a cluster it
//! authenticates as its service account, with the token and CA from the standard paths; the
//! token is read again for every call (projected tokens are rotated).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::Value;

use crate::gates::{GATED_LABEL, GatedPod};

/// Where a pod finds its service account's credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// An API server and how to authenticate to it.
pub struct Kube {
    scheme_https: bool,
    host: String,
    port: u16,
    token_file: Option<PathBuf>,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl Kube {
    /// The API server of the cluster this pod runs in: `KUBERNETES_SERVICE_HOST` and `_PORT`,
    /// the service account's token and CA.
    pub fn in_cluster() -> anyhow::Result<Kube> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST")
            .context("KUBERNETES_SERVICE_HOST is not set: not in a pod (give --api-server)")?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        Kube::new(
            &format!("https://{host}:{port}"),
            Some(dir.join("token")),
            Some(&dir.join("ca.crt")),
        )
    }

    /// The API server at `url` (`https://host:port`, or `http://` for a local proxy), with a
    /// bearer token read from `token_file` for each call and the CA bundle `ca` (default the
    /// system's roots are not used: an API server's CA is the cluster's own).
    pub fn new(url: &str, token_file: Option<PathBuf>, ca: Option<&Path>) -> anyhow::Result<Kube> {
        let (scheme, rest) = url
            .split_once("://")
            .with_context(|| format!("--api-server {url:?}: not scheme://host:port"))?;
        let scheme_https = match scheme {
            "https" => true,
            "http" => false,
            other => bail!("--api-server {url:?}: scheme {other:?} is neither https nor http"),
        };
        let authority = rest.trim_end_matches('/');
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !p.contains(']') => (
                h.to_owned(),
                p.parse()
                    .with_context(|| format!("--api-server {url:?}: port {p:?}"))?,
            ),
            _ => (authority.to_owned(), if scheme_https { 443 } else { 80 }),
        };
        let tls = if scheme_https {
            let ca = ca.context("an https API server needs its CA (--api-ca)")?;
            Some(tls_connector(ca)?)
        } else {
            None
        };
        Ok(Kube {
            scheme_https,
            host,
            port,
            token_file,
            tls,
        })
    }

    /// Sends one request; returns the status and body.
    async fn call(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
    ) -> anyhow::Result<(hyper::StatusCode, Bytes)> {
        let mut req = hyper::Request::builder()
            .method(method.clone())
            .uri(path)
            .header(hyper::header::HOST, format!("{}:{}", self.host, self.port))
            .header(hyper::header::ACCEPT, "application/json");
        if let Some(file) = &self.token_file {
            let token = std::fs::read_to_string(file)
                .with_context(|| format!("reading the API token {}", file.display()))?;
            req = req.header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", token.trim()),
            );
        }
        let body = match body {
            Some((content_type, bytes)) => {
                req = req.header(hyper::header::CONTENT_TYPE, content_type);
                Full::new(Bytes::from(bytes))
            }
            None => Full::new(Bytes::new()),
        };
        let req = req.body(body)?;
        let what = format!("{method} {path} on {}:{}", self.host, self.port);
        let tcp = tokio::net::TcpStream::connect((self.host.trim_matches(['[', ']']), self.port))
            .await
            .with_context(|| format!("{what}: connecting"))?;
        let res = match &self.tls {
            Some(tls) if self.scheme_https => {
                let name = rustls::pki_types::ServerName::try_from(
                    self.host.trim_matches(['[', ']']).to_owned(),
                )
                .with_context(|| format!("{what}: server name"))?;
                let stream = tls
                    .connect(name, tcp)
                    .await
                    .with_context(|| format!("{what}: TLS"))?;
                send(hyper_util::rt::TokioIo::new(stream), req).await
            }
            _ => send(hyper_util::rt::TokioIo::new(tcp), req).await,
        }
        .with_context(|| what.clone())?;
        let status = res.status();
        let bytes = res.into_body().collect().await?.to_bytes();
        Ok((status, bytes))
    }

    /// The pods labelled [`GATED_LABEL`]`=true` (in `namespace`, or in every namespace), with
    /// their gates.
    pub async fn gated_pods(&self, namespace: Option<&str>) -> anyhow::Result<Vec<GatedPod>> {
        let path = match namespace {
            Some(ns) => format!("/api/v1/namespaces/{ns}/pods"),
            None => "/api/v1/pods".to_owned(),
        };
        let selector = format!("{GATED_LABEL}=true").replace('/', "%2F");
        let path = format!("{path}?labelSelector={}", selector.replace('=', "%3D"));
        let (status, body) = self.call(hyper::Method::GET, &path, None).await?;
        ensure!(
            status.is_success(),
            "listing pods: {status}: {}",
            String::from_utf8_lossy(&body)
        );
        let list: Value = serde_json::from_slice(&body).context("listing pods: not JSON")?;
        Ok(list
            .get("items")
            .and_then(Value::as_array)
            .map(|items| items.iter().filter_map(GatedPod::from_api).collect())
            .unwrap_or_default())
    }

    /// Applies a JSON patch (RFC 6902) to the pod.
    pub async fn patch_pod(&self, pod: &GatedPod, patch: &Value) -> anyhow::Result<()> {
        let path = format!("/api/v1/namespaces/{}/pods/{}", pod.namespace, pod.name);
        let body = serde_json::to_vec(patch)?;
        let (status, answer) = self
            .call(
                hyper::Method::PATCH,
                &path,
                Some(("application/json-patch+json", body)),
            )
            .await?;
        ensure!(
            status.is_success(),
            "patching pod {}/{}: {status}: {}",
            pod.namespace,
            pod.name,
            String::from_utf8_lossy(&answer)
        );
        Ok(())
    }
}

async fn send<S>(
    io: hyper_util::rt::TokioIo<S>,
    req: hyper::Request<Full<Bytes>>,
) -> anyhow::Result<hyper::Response<hyper::body::Incoming>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender.send_request(req).await?)
}

/// A TLS connector trusting only the certificates of the PEM bundle `ca`.
fn tls_connector(ca: &Path) -> anyhow::Result<tokio_rustls::TlsConnector> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("reading the API server's CA {}", ca.display()))?
    {
        let cert = cert.with_context(|| format!("a certificate of {}", ca.display()))?;
        roots
            .add(cert)
            .with_context(|| format!("a certificate of {}", ca.display()))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}
