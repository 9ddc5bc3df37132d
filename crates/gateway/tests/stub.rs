//! The gateway against a stand-in OpenDsec API (no sandboxes, no root): routing, tokens,
//! Connect framing of a process stream, and malformed requests.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

const ID: &str = "stub-abcdefghjkmn";

fn info(id: &str) -> Value {
    json!({
        "id": id, "edge": "stub", "backend": "container", "image": "root/py:3.11",
        "state": "running",
        "limits": {"cpu_cores": 1.0, "memory_mb": 512, "disk_mb": 1024, "pids": 100},
        "created_at_ms": 1_700_000_000_000u64, "expires_at_ms": 1_700_000_300_000u64,
        "labels": {"e2b.template": "base", "e2b.public_traffic": "true", "k": "v"},
        "port_token": "pt-stub",
    })
}

async fn serve(app: Router) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    a
}

/// The API's port proxy: port 8080 has nothing listening (the proxy's own error, marked);
/// any other port echoes what reached it.
async fn port_proxy(
    Path((id, port, rest)): Path<(String, u16, String)>,
    req: axum::extract::Request,
) -> axum::response::Response {
    if port == 8080 {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [("dsec-port-error", "unavailable")],
            axum::Json(json!({"code": "unavailable", "message": "connection refused"})),
        )
            .into_response();
    }
    let hs = req.headers().clone();
    let h = |n: &str| {
        hs.get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string()
    };
    let line = format!(
        "{} {id} {port} /{rest}?{} auth={} token={} e2b={}",
        req.method(),
        req.uri().query().unwrap_or(""),
        h("authorization"),
        h("x-dsec-token"),
        h("e2b-sandbox-id"),
    );
    let body = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        StatusCode::IM_A_TEAPOT,
        format!("{line} body={}", String::from_utf8_lossy(&body)),
    )
        .into_response()
}

async fn setup() -> (SocketAddr, String) {
    setup_with(false).await
}

/// The gateway over the stand-in API; `in_process`: it calls the API's router directly,
/// its `api_url` naming a port where nothing listens.
async fn setup_with(in_process: bool) -> (SocketAddr, String) {
    let api = Router::new()
        .route(
            "/v1/sandboxes/{id}/ports/{port}/{*rest}",
            axum::routing::any(port_proxy),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(|Path(id): Path<String>| async move {
                if id == ID {
                    axum::Json(info(&id)).into_response()
                } else {
                    (StatusCode::NOT_FOUND, axum::Json(json!({"code": "not_found", "message": "no"})))
                        .into_response()
                }
            }),
        )
        .route(
            "/v1/sandboxes/{id}/exec",
            post(|body: Bytes| async move {
                let req: Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(req["argv"], json!(["/bin/bash", "-l", "-c", "echo hi"]));
                assert_eq!(req["stdin"], json!(""));
                assert_eq!(req["timeout_seconds"], json!(5.0));
                "{\"type\":\"start\",\"pid\":42}\n{\"type\":\"stdout\",\"data\":\"aGkK\"}\n{\"type\":\"exit\",\"exit_code\":2}\n"
            }),
        );
    let (api_url, local) = if in_process {
        let l: dsec_gateway::upstream::InProcess = Default::default();
        let _ = l.set(api);
        ("http://127.0.0.1:9".to_string(), Some(l))
    } else {
        (format!("http://{}", serve(api).await), None)
    };
    let secret = b"s3cret".to_vec();
    let token = dsec_gateway::access_token(&secret, ID);
    let gw = dsec_gateway::router(dsec_gateway::Config {
        api_url,
        service_key: "dsk.service".into(),
        secret,
        templates: BTreeMap::new(),
        domain: Some("sb.test".into()),
        builder: None,
        in_process: local,
    });
    (serve(gw).await, token)
}

async fn send(
    gw: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (StatusCode, Vec<u8>) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut b = Request::post(format!("http://{gw}{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let r = client
        .request(b.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let s = r.status();
    (
        s,
        r.into_body().collect().await.unwrap().to_bytes().to_vec(),
    )
}

/// The frames of a Connect stream body: (flags, JSON).
fn frames(mut b: &[u8]) -> Vec<(u8, Value)> {
    let mut out = vec![];
    while b.len() >= 5 {
        let n = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        out.push((b[0], serde_json::from_slice(&b[5..5 + n]).unwrap()));
        b = &b[5 + n..];
    }
    assert!(b.is_empty());
    out
}

#[tokio::test]
async fn a_process_stream_is_framed_as_connect_events() {
    let (gw, token) = setup().await;
    process_stream_is_framed(gw, token).await;
}

/// The same, with the API's router called in the gateway's process: nothing listens at
/// its `api_url`, so every answer came from the router.
#[tokio::test]
async fn a_process_stream_is_framed_the_same_in_process() {
    let (gw, token) = setup_with(true).await;
    process_stream_is_framed(gw, token).await;
}

async fn process_stream_is_framed(gw: SocketAddr, token: String) {
    let start =
        json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"]}, "stdin": false});
    let body = dsec_gateway::connect::message(&start);
    let h = [
        ("e2b-sandbox-id", ID),
        ("e2b-sandbox-port", "49983"),
        ("x-access-token", token.as_str()),
        ("content-type", "application/connect+json"),
        ("connect-timeout-ms", "5000"),
    ];
    let (s, b) = send(gw, "/process.Process/Start", &h, body).await;
    assert_eq!(s, StatusCode::OK);
    let f = frames(&b);
    assert_eq!(f[0], (0, json!({"event": {"start": {"pid": 42}}})));
    assert_eq!(f[1], (0, json!({"event": {"data": {"stdout": "aGkK"}}})));
    assert_eq!(f[2].1["event"]["end"]["exitCode"], 2);
    assert_eq!(f[3], (2, json!({})));

    // malformed bodies: an end frame with an error, HTTP 200
    for bad in [
        vec![0u8, 0, 0],
        vec![0, 0xff, 0xff, 0xff, 0xff],
        vec![1, 0, 0, 0, 0],
        b"{}".to_vec(),
    ] {
        let (s, b) = send(gw, "/process.Process/Start", &h, bad).await;
        assert_eq!(s, StatusCode::OK);
        let f = frames(&b);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].0, 2);
        assert!(f[0].1["error"]["code"].is_string());
    }
    // a Start without a command
    let (_, b) = send(
        gw,
        "/process.Process/Start",
        &h,
        dsec_gateway::connect::message(&json!({})),
    )
    .await;
    assert_eq!(frames(&b)[0].1["error"]["code"], "invalid_argument");
}

#[tokio::test]
async fn sandboxes_tokens_and_ports_are_checked() {
    let (gw, token) = setup().await;
    let base = [("e2b-sandbox-id", ID), ("content-type", "application/json")];
    // no token, a wrong token, another sandbox's token
    let (s, _) = send(gw, "/process.Process/List", &base, b"{}".to_vec()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let other = dsec_gateway::access_token(b"s3cret", "stub-zzzzzzzzzzzz");
    let h = [base[0], base[1], ("x-access-token", other.as_str())];
    let (s, _) = send(gw, "/process.Process/List", &h, b"{}".to_vec()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // an unknown (or malformed) sandbox is the edge's 502 "not found"
    let t2 = dsec_gateway::access_token(b"s3cret", "stub-zzzzzzzzzzzz");
    let h = [
        ("e2b-sandbox-id", "stub-zzzzzzzzzzzz"),
        ("x-access-token", t2.as_str()),
    ];
    let (s, b) = send(gw, "/process.Process/List", &h, b"{}".to_vec()).await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert!(String::from_utf8_lossy(&b).contains("was not found"));
    let h = [
        ("e2b-sandbox-id", "../../v1/status"),
        ("x-access-token", "x"),
    ];
    let (s, _) = send(gw, "/process.Process/List", &h, b"{}".to_vec()).await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    // another port
    let h = [
        base[0],
        ("e2b-sandbox-port", "8080"),
        ("x-access-token", token.as_str()),
    ];
    let (s, b) = send(gw, "/process.Process/List", &h, b"{}".to_vec()).await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert!(String::from_utf8_lossy(&b).contains("port is not open"));
    // an open port: the request goes there as it is (the sandbox server's answer too),
    // with the port token and without the E2B routing headers
    let host = format!("8081-{ID}.sb.test");
    let h = [("host", host.as_str()), ("authorization", "Basic YTpi")];
    let (s, b) = send(gw, "/some/where?q=1", &h, b"payload".to_vec()).await;
    assert_eq!(s, StatusCode::IM_A_TEAPOT);
    assert_eq!(
        String::from_utf8_lossy(&b),
        format!("POST {ID} 8081 /some/where?q=1 auth=Basic YTpi token=pt-stub e2b=- body=payload")
    );
    // a host naming an unknown sandbox
    let (s, b) = send(
        gw,
        "/",
        &[("host", "8081-stub-zzzzzzzzzzzz.sb.test")],
        vec![],
    )
    .await;
    assert_eq!(s, StatusCode::BAD_GATEWAY);
    assert!(String::from_utf8_lossy(&b).contains("was not found"));
    // bad unary bodies and codecs
    let h = [base[0], base[1], ("x-access-token", token.as_str())];
    let (s, b) = send(gw, "/filesystem.Filesystem/Stat", &h, b"{nope".to_vec()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(
        serde_json::from_slice::<Value>(&b).unwrap()["code"],
        "invalid_argument"
    );
    let h = [
        base[0],
        ("content-type", "application/proto"),
        ("x-access-token", token.as_str()),
    ];
    // binary protobuf is transcoded; a truncated message is the caller's error
    let (s, b) = send(gw, "/filesystem.Filesystem/Stat", &h, vec![10, 5, b'/']).await;
    assert_eq!(
        s,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert!(String::from_utf8_lossy(&b).contains("truncated"));
    // a codec it does not speak
    let h = [
        base[0],
        ("content-type", "application/xml"),
        ("x-access-token", token.as_str()),
    ];
    let (s, _) = send(gw, "/filesystem.Filesystem/Stat", &h, b"<x/>".to_vec()).await;
    assert_eq!(s, StatusCode::NOT_IMPLEMENTED);
    // a user name that would change a path
    let h = [
        base[0],
        base[1],
        ("x-access-token", token.as_str()),
        ("authorization", "Basic Li4vZXRjOg=="),
    ];
    let (s, _) = send(
        gw,
        "/filesystem.Filesystem/Stat",
        &h,
        b"{\"path\":\"~\"}".to_vec(),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn control_plane_errors_are_e2b_json() {
    let (gw, _) = setup().await;
    let (s, b) = send(
        gw,
        "/v2/sandboxes",
        &[],
        b"{\"templateID\":\"base\"}".to_vec(),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["code"], 401);
    let h = [("x-api-key", "dsk.x"), ("content-type", "application/json")];
    let (s, b) = send(
        gw,
        "/v2/sandboxes",
        &h,
        b"{\"templateID\":\"nope\"}".to_vec(),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(serde_json::from_slice::<Value>(&b).unwrap()["code"], 404);
    let (s, b) = send(gw, "/v2/sandboxes", &h, b"[1]".to_vec()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(serde_json::from_slice::<Value>(&b).unwrap()["message"].is_string());
    let (s, _) = send(
        gw,
        "/sandboxes/bad..id/timeout",
        &h,
        b"{\"timeout\":5}".to_vec(),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}
