//! The S3 helper starts a real SeaweedFS server that the AWS SDK can use.

use anyhow::Result;
use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_s3::primitives::ByteStream;
use stagehand_testkit::{S3Error, S3Server};

fn client(s3: &S3Server) -> aws_sdk_s3::Client {
    use aws_smithy_http_client::tls;
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let config = aws_sdk_s3::Config::builder()
        .http_client(http)
        .behavior_version(BehaviorVersion::v2026_01_12())
        .endpoint_url(s3.endpoint())
        .force_path_style(true)
        .region(Region::new(s3.region()))
        .credentials_provider(Credentials::new(
            s3.access_key(),
            s3.secret_key(),
            None,
            None,
            "stagehand-testkit",
        ))
        .request_checksum_calculation(aws_sdk_s3::config::RequestChecksumCalculation::WhenRequired)
        .response_checksum_validation(aws_sdk_s3::config::ResponseChecksumValidation::WhenRequired)
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

#[tokio::test]
async fn shared_server_bucket_put_and_get_with_the_sdk() -> Result<()> {
    let s3 = S3Server::shared();
    let bucket = s3.unique_bucket("put-get");
    let client = client(s3);
    client
        .put_object()
        .bucket(&bucket)
        .key("dir/a.bin")
        .body(ByteStream::from_static(b"stagehand bytes"))
        .send()
        .await?;
    let got = client
        .get_object()
        .bucket(&bucket)
        .key("dir/a.bin")
        .send()
        .await?
        .body
        .collect()
        .await?
        .into_bytes();
    assert_eq!(&got[..], b"stagehand bytes");

    // The testkit's own signed requests see the same object.
    assert_eq!(s3.get_object(&bucket, "dir/a.bin")?, b"stagehand bytes");
    Ok(())
}

#[tokio::test]
async fn shared_server_gives_each_test_its_own_bucket() -> Result<()> {
    let s3 = S3Server::shared();
    let a = s3.unique_bucket("own");
    let b = s3.unique_bucket("own");
    assert_ne!(a, b);
    s3.put_object(&a, "k", b"in a")?;
    match s3.get_object(&b, "k") {
        Err(S3Error::Status { status: 404, .. }) => {}
        other => panic!("expected 404 for a key of another bucket, got {other:?}"),
    }
    let listed = client(s3).list_buckets().send().await?;
    let names: Vec<_> = listed.buckets().iter().filter_map(|b| b.name()).collect();
    assert!(
        names.contains(&a.as_str()) && names.contains(&b.as_str()),
        "{names:?}"
    );
    Ok(())
}

#[test]
fn own_server_refuses_unsigned_requests_and_is_removed_on_drop() {
    use std::io::{Read, Write};
    let s3 = S3Server::start();
    let bucket = s3.unique_bucket("own-server");
    s3.put_object(&bucket, "x", b"1").unwrap();

    let mut conn = std::net::TcpStream::connect(("127.0.0.1", s3.port())).unwrap();
    write!(
        conn,
        "GET /{bucket}/x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");

    let log = s3.log_path();
    assert!(log.exists());
    drop(s3);
    assert!(!log.exists());
}
