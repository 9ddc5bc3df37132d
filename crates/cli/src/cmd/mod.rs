pub mod certs;
pub mod commit;
pub mod events;
pub mod gateway;
pub mod iam;
pub mod image;
pub mod pause;
pub mod role;
pub mod runtime;
pub mod sandbox;
pub mod snapshot;
pub mod top;
pub mod up;
pub mod volume;

use anyhow::Result;

use crate::ApiArgs;
use crate::client::{self, Api};

/// An API client from the command's flags, the environment or the client config file.
pub fn api(a: &ApiArgs) -> Result<Api> {
    Api::new(&client::resolve(
        a.api_url.as_deref(),
        a.api_key.as_deref(),
        None,
    )?)
}

/// Accept queue of the servers' TCP listeners (the kernel caps it at `net.core.somaxconn`).
const LISTEN_BACKLOG: u32 = 4096;

/// A TCP listener with a deep accept queue. With the default of 128, a thousand clients
/// connecting at once (a burst of creates) overflowed it, and the connections dropped
/// waited out SYN retransmits (1 s, 3 s, 7 s, ...) or gave up.
pub(crate) async fn listen(
    addr: impl tokio::net::ToSocketAddrs,
) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let s = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        // As the standard library's listeners do: a restarted server binds at once.
        s.set_reuseaddr(true)?;
        match s.bind(a).and_then(|()| s.listen(LISTEN_BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address to listen on")
    }))
}
