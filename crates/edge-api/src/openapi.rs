//! The API description every apiserver serves at `/openapi.json`, generated from the
//! handlers' `#[utoipa::path]` attributes and the API's own types (their doc comments the
//! descriptions). `tests/openapi.rs` fails when the committed copy
//! (`crates/common/openapi.json`) is not what this makes.

use dsec_common::ApiError;
use dsec_common::api::*;
use dsec_common::channel::PtySize;
use dsec_common::error::ErrorReply;
use dsec_iam::Quota;
use serde_json::Value;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, Schema, SchemaFormat, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "OpenDsec API",
        version = "0.1.0",
        description = "Sandboxes for agents and RL rollouts. Authenticate with \
            `Authorization: Bearer dsk.…`. Every error is `{\"code\": \"...\", \
            \"message\": \"...\"}` with a matching HTTP status.",
        license(name = "Apache-2.0"),
    ),
    paths(
        crate::status,
        crate::images,
        crate::build_image,
        crate::create,
        crate::list,
        crate::get_one,
        crate::stop,
        crate::exec,
        crate::fork,
        crate::pause,
        crate::resume,
        crate::pause_group,
        crate::resume_group,
        crate::set_timeout,
        crate::commit,
        crate::set_network,
        crate::metrics,
        crate::metrics_history,
        crate::usage,
        crate::functions,
        crate::call_function,
        crate::metrics_text,
    ),
    components(
        responses(ErrorReply),
        // Types the operations do not name but clients read (inside other answers or
        // streams) are listed so that their schemas are in the document too.
        schemas(
            ApiError,
            BackendStatus,
            Capability,
            ClusterStatus,
            CommitRequest,
            CommitResponse,
            CreateSandboxRequest,
            CreateVolumeRequest,
            Delivery,
            Event,
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
            ListEventsResponse,
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
            WebhookFormat,
            WebhookInfo,
            WebhookRequest,
            WebhookUpdate,
        ),
    ),
    security(("apiKey" = [])),
    modifiers(&BearerKey),
)]
struct Api;

/// `Authorization: Bearer …`, the API key (an operation that needs none says so).
struct BearerKey;

impl Modify for BearerKey {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let scheme =
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build());
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme("apiKey", scheme);
    }
}

/// The sandbox a route names.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct SandboxPath {
    /// The sandbox's id, as create returned it (`<edge>-<12 characters of [0-9a-z]>`).
    #[allow(dead_code)]
    id: String,
}

/// The trajectory step a call is (see `runtime::step_ref`): a step already recorded is
/// answered from the record, marked `X-Dsec-Replayed: true`, instead of being run again.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Header)]
pub(crate) struct StepHeaders {
    /// The trajectory the call is a step of.
    #[param(rename = "X-Dsec-Trajectory")]
    #[allow(dead_code)]
    trajectory: Option<String>,
    /// The step's number in it.
    #[param(rename = "X-Dsec-Step")]
    #[allow(dead_code)]
    step: Option<u64>,
}

/// Bytes as they are (`application/octet-stream`): a binary string, not an array of
/// numbers as `Vec<u8>` would be described.
pub(crate) struct Binary;

impl utoipa::PartialSchema for Binary {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .into()
    }
}

impl utoipa::ToSchema for Binary {}

/// The whole description: this crate's routes, IAM's and the health check.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = Api::openapi();
    doc.merge(crate::runtime::Doc::openapi());
    doc.merge(crate::snapshots::Doc::openapi());
    doc.merge(crate::events::Doc::openapi());
    doc.merge(crate::volumes::Doc::openapi());
    doc.merge(crate::images::Doc::openapi());
    doc.merge(crate::ports::Doc::openapi());
    doc.merge(dsec_iam::http::Doc::openapi());
    doc.merge(dsec_common::http::HealthDoc::openapi());
    doc
}

/// [`document`] as the JSON that is committed and served.
pub fn json() -> String {
    let mut doc = serde_json::to_value(document()).expect("the description is JSON");
    optional_bodies(&mut doc);
    serde_json::to_string_pretty(&doc).expect("the description is JSON") + "\n"
}

/// A body that may be left out is described by its type alone (with `required` unset),
/// not as "the type or JSON `null`", which is how an `Option` is described elsewhere.
fn optional_bodies(doc: &mut Value) {
    let Some(paths) = doc["paths"].as_object_mut() else {
        return;
    };
    let ops = paths
        .values_mut()
        .filter_map(Value::as_object_mut)
        .flat_map(|i| i.values_mut());
    for op in ops {
        let Some(body) = op.get_mut("requestBody") else {
            continue;
        };
        if body["required"] == true {
            continue;
        }
        let Some(content) = body["content"].as_object_mut() else {
            continue;
        };
        for media in content.values_mut() {
            let schema = &mut media["schema"];
            let Some([a, b]) = schema["oneOf"].as_array().map(Vec::as_slice) else {
                continue;
            };
            let inner = match (a["type"] == "null", b["type"] == "null") {
                (true, false) => b.clone(),
                (false, true) => a.clone(),
                _ => continue,
            };
            *schema = inner;
        }
    }
}
