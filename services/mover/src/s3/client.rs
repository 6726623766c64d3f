//! Building the SDK client the way S3-compatible servers need it: path-style addressing, a
//! fixed region, checksums only when asked for (the SDK's default CRC32 trailers break several
//! non-AWS servers), a pinned behaviour version, rustls with ring for HTTPS (plain HTTP works
//! through the same connector), and the SDK's own retries configured once.

use std::time::Duration;

use aws_config::environment::credentials::EnvironmentVariableCredentialsProvider;
use aws_config::meta::credentials::CredentialsProviderChain;
use aws_config::profile::ProfileFileCredentialsProvider;
use aws_config::provider_config::ProviderConfig;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{
    BehaviorVersion, Region, RequestChecksumCalculation, ResponseChecksumValidation,
    StalledStreamProtectionConfig,
};
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};

use super::config::S3Config;
use crate::error::TransferError;

/// Where the client's credentials come from.
pub(crate) enum Credentials {
    /// `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, then the profile
    /// (`config.profile`, else `AWS_PROFILE`, else `default`) in the shared files. Instance
    /// metadata is deliberately not consulted: a tier's credentials are configured, not guessed.
    EnvOrProfile,
    Static {
        access_key_id: String,
        secret_access_key: String,
    },
}

/// Attempts per request, the first included (the SDK's standard retry mode with jitter).
const MAX_ATTEMPTS: u32 = 4;
/// How long a body may make no progress before the SDK fails it; local servers under load
/// pause for seconds, so the 5 s default fires spuriously.
const STALL_GRACE: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) fn build(
    config: &S3Config,
    credentials: Credentials,
) -> Result<aws_sdk_s3::Client, TransferError> {
    let http_client = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let mut builder = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::v2026_01_12())
        .region(Region::new(config.region.clone()))
        .http_client(http_client.clone())
        .force_path_style(config.path_style)
        .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
        .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
        .stalled_stream_protection(
            StalledStreamProtectionConfig::enabled()
                .grace_period(STALL_GRACE)
                .build(),
        )
        .retry_config(
            RetryConfig::standard()
                .with_max_attempts(MAX_ATTEMPTS)
                .with_initial_backoff(Duration::from_millis(200)),
        )
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .build(),
        );
    if let Some(endpoint) = &config.endpoint {
        builder = builder.endpoint_url(endpoint.trim_end_matches('/'));
    }
    builder = match credentials {
        Credentials::Static {
            access_key_id,
            secret_access_key,
        } => builder.credentials_provider(aws_sdk_s3::config::Credentials::new(
            access_key_id,
            secret_access_key,
            None,
            None,
            "stagehand-static",
        )),
        Credentials::EnvOrProfile => {
            // The profile provider needs an HTTP client of its own (for roles and SSO profiles);
            // it gets the same rustls one, and the tier's region.
            let provider_config = ProviderConfig::without_region()
                .with_http_client(http_client)
                .with_region(Some(Region::new(config.region.clone())));
            let mut profile = ProfileFileCredentialsProvider::builder().configure(&provider_config);
            if let Some(name) = &config.profile {
                profile = profile.profile_name(name);
            }
            let chain = if config.profile.is_some() {
                // A named profile is an explicit choice: it wins over ambient variables.
                CredentialsProviderChain::first_try("profile", profile.build())
                    .or_else("environment", EnvironmentVariableCredentialsProvider::new())
            } else {
                CredentialsProviderChain::first_try(
                    "environment",
                    EnvironmentVariableCredentialsProvider::new(),
                )
                .or_else("profile", profile.build())
            };
            builder.credentials_provider(chain)
        }
    };
    Ok(aws_sdk_s3::Client::from_conf(builder.build()))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Regression: the profile provider built an instance-metadata client without an HTTP
    // client and panicked while the tier was being connected.
    #[test]
    fn clients_build_with_every_credential_source() {
        let mut config = S3Config::new("data", "");
        config.endpoint = Some("http://127.0.0.1:1".into());
        build(&config, Credentials::EnvOrProfile).unwrap();
        config.profile = Some("archive".into());
        build(&config, Credentials::EnvOrProfile).unwrap();
        build(
            &config,
            Credentials::Static {
                access_key_id: "k".into(),
                secret_access_key: "s".into(),
            },
        )
        .unwrap();
    }
}
