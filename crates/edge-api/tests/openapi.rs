//! `crates/common/openapi.json`, the document every apiserver serves at `/openapi.json`,
//! is generated: its schemas come from the API's own types (utoipa derives on
//! `dsec_common::api` and the rest, their doc comments the descriptions), the rest
//! (info, paths, responses, security) from the hand-kept `crates/common/openapi-source.json`.
//! This test fails when the committed document is not what they generate; run it with
//! `DSEC_WRITE_OPENAPI=1` to write it.

use dsec_common::ApiError;
use dsec_common::api::*;
use dsec_common::channel::PtySize;
use dsec_iam::Quota;
use serde_json::Value;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(components(schemas(
    ApiError,
    BackendStatus,
    Capability,
    ClusterStatus,
    CommitRequest,
    CommitResponse,
    CreateSandboxRequest,
    CreateVolumeRequest,
    ExecRequest,
    ExecResult,
    FileStat,
    ForkRequest,
    ForkResponse,
    FunctionCallRequest,
    FunctionCallResult,
    FunctionInfo,
    GroupFailure,
    GroupRequest,
    GroupResponse,
    Limits,
    ListSandboxesResponse,
    ListSnapshotsResponse,
    ListVolumesResponse,
    MetricsHistory,
    MetricsSample,
    NetworkInfo,
    NodeStatus,
    PauseRequest,
    ProcessInfo,
    PtySize,
    Quota,
    ResumeRequest,
    SandboxInfo,
    SandboxMetrics,
    SessionCreateRequest,
    SessionInfo,
    SessionResult,
    SessionRunRequest,
    SetNetworkRequest,
    SetTimeoutRequest,
    SnapshotInfo,
    VolumeEntry,
    VolumeEntryUpdate,
    VolumeInfo,
    VolumeMount,
)))]
struct Schemas;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../common")
}

/// The document the types and the hand-kept part make.
fn generated() -> String {
    let mut doc: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("openapi-source.json")).unwrap())
            .unwrap();
    let schemas = Schemas::openapi().components.expect("components").schemas;
    doc["components"]["schemas"] = serde_json::to_value(schemas).unwrap();
    serde_json::to_string_pretty(&doc).unwrap() + "\n"
}

#[test]
fn the_served_document_is_the_generated_one() {
    let want = generated();
    let path = root().join("openapi.json");
    if std::env::var_os("DSEC_WRITE_OPENAPI").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap();
    assert!(
        have == want,
        "{} is stale: the API's types changed; regenerate it with \
         `DSEC_WRITE_OPENAPI=1 cargo test -p dsec-edge-api --test openapi` and commit it",
        path.display()
    );
    // What is served is that file.
    assert_eq!(dsec_common::http::OPENAPI, have);
}

/// Every `$ref` in the document names a schema or a response it has (a path that names
/// a type no longer generated fails here).
#[test]
fn every_reference_resolves() {
    let doc: Value = serde_json::from_str(&generated()).unwrap();
    fn walk(v: &Value, doc: &Value, bad: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    let ptr = r.trim_start_matches('#');
                    if doc.pointer(ptr).is_none() {
                        bad.push(r.clone());
                    }
                }
                m.values().for_each(|x| walk(x, doc, bad));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, doc, bad)),
            _ => {}
        }
    }
    let mut bad = Vec::new();
    walk(&doc, &doc, &mut bad);
    assert!(bad.is_empty(), "unresolved references: {bad:?}");
}
