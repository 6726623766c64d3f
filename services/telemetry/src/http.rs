//! The small HTTP/1.1 that Stagehand's read-only endpoints speak (a service's `/metrics`,
//! `stagehand status --serve`): one request per connection, its head read within a bound of
//! size and time, one response that closes the connection. No body is read: every route is
//! a `GET`.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest request head read.
const MAX_REQUEST: usize = 8 * 1024;
/// How long a client may take to send its request head.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A request's method and path (its target without the query).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
}

/// Reads the head of the one request of `stream`, within 8 KiB and 10 s; a head cut short
/// gives empty fields, which no route matches.
pub async fn read_head(stream: &mut TcpStream) -> std::io::Result<RequestHead> {
    let mut head = Vec::with_capacity(512);
    let read = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(REQUEST_TIMEOUT, read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request head"))??;
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_owned();
    let target = parts.next().unwrap_or("");
    let path = target.split('?').next().unwrap_or("").to_owned();
    Ok(RequestHead { method, path })
}

/// Writes one response (`status` such as `200 OK`, then `extra_headers`: whole header lines,
/// each ending in `\r\n`) and closes the connection's write side.
pub async fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    extra_headers: &str,
    body: &str,
) -> std::io::Result<()> {
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         {extra_headers}Connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
