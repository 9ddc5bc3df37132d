//! Per-call cost of the transports between roles, on loopback over mutual TLS: sequential
//! unary gRPC calls next to sequential HTTP/1.1 requests to the same listener (a node
//! status each way). `grpc` or `http` as a second argument runs one side only (for
//! `strace -c`: a unary gRPC call here takes three writes and three reads, the response's
//! trailers a frame of their own, where HTTP/1.1 takes two).
//!
//!     cargo run --release -p dsec-rpc --example hop -- 3000

use std::time::Instant;

use dsec_mtls::{Role, Tls, TlsFiles, pki};
use dsec_rpc::pb::edge_server::{Edge, EdgeServer};
use dsec_rpc::{Channels, pb};
use tonic::{Request, Response, Status};

struct Fake;

#[tonic::async_trait]
impl Edge for Fake {
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::NodeStatus>, Status> {
        let mut n = dsec_common::api::NodeStatus::unreachable("e1");
        n.healthy = true;
        Ok(Response::new(n.into()))
    }
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    let only = std::env::args().nth(2).unwrap_or_default();
    let dir = tempfile::tempdir().unwrap();
    pki::init_ca(dir.path()).unwrap();
    for (r, name) in [(Role::Edge, "e1"), (Role::Apiserver, "a1")] {
        pki::issue(dir.path(), r, name, &["127.0.0.1".to_string()]).unwrap();
    }
    let edge = Tls::load(&TlsFiles::in_dir(dir.path(), "e1")).unwrap();
    let api = Tls::load(&TlsFiles::in_dir(dir.path(), "a1")).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let app = dsec_rpc::routes(EdgeServer::new(Fake)).route(
        "/v1/status",
        axum::routing::get(|| async {
            let mut n = dsec_common::api::NodeStatus::unreachable("e1");
            n.healthy = true;
            axum::Json(n)
        }),
    );
    dsec_mtls::server::spawn(l, &edge, &[Role::Apiserver], app);

    let rpc = Channels::new(Some(api.client.clone()));
    let http = dsec_mtls::Client::new(Some(api.client.clone()));
    let url = format!("https://{addr}/v1/status");
    for round in 0..2 {
        let t = Instant::now();
        for _ in 0..if only == "http" { 0 } else { n } {
            let mut c = rpc
                .client(&addr, pb::edge_client::EdgeClient::with_origin)
                .unwrap();
            c.status(pb::StatusRequest {}).await.unwrap();
        }
        let grpc = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        let t = Instant::now();
        for _ in 0..if only == "grpc" { 0 } else { n } {
            let req = hyper::Request::get(&url)
                .body(dsec_mtls::client::Body::empty())
                .unwrap();
            let resp = http.request(req).await.unwrap();
            use http_body_util::BodyExt;
            resp.into_body().collect().await.unwrap();
        }
        let h1 = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!(
            "round {round}: gRPC {grpc:.0} µs/call, HTTP/1.1 {h1:.0} µs/call ({n} sequential calls each)"
        );
    }
}
