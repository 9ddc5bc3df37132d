//! HTTP helpers the servers share (feature `http`).

use hyper::StatusCode;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

/// Proxying an upgrade (WebSocket and the like): once the far side answered 101, the
/// client's upgraded connection and the far side's are joined, bytes both ways.
pub fn splice_upgrade<B>(client: Option<OnUpgrade>, resp: &mut hyper::Response<B>) {
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return;
    }
    let Some(client) = client else { return };
    let far = hyper::upgrade::on(resp);
    tokio::spawn(async move {
        if let (Ok(a), Ok(b)) = (client.await, far.await) {
            let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(a), &mut TokioIo::new(b)).await;
        }
    });
}
