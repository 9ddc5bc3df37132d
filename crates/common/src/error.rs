//! The one error shape every API returns: an HTTP status, a machine-readable code and a
//! sentence that says what to fix.

use serde::{Deserialize, Serialize};

/// Machine-readable error codes. The HTTP status follows from the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidArgument,
    Unauthenticated,
    PermissionDenied,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    ResourceExhausted,
    Unimplemented,
    Unavailable,
    DeadlineExceeded,
    Internal,
}

impl ErrorCode {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument => 400,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::AlreadyExists => 409,
            ErrorCode::FailedPrecondition => 409,
            ErrorCode::ResourceExhausted => 429,
            ErrorCode::Unimplemented => 501,
            ErrorCode::Unavailable => 503,
            ErrorCode::DeadlineExceeded => 504,
            ErrorCode::Internal => 500,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::NotFound => "not_found",
            ErrorCode::AlreadyExists => "already_exists",
            ErrorCode::FailedPrecondition => "failed_precondition",
            ErrorCode::ResourceExhausted => "resource_exhausted",
            ErrorCode::Unimplemented => "unimplemented",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::Internal => "internal",
        }
    }
}

/// The document's one reusable error response (`#/components/responses/Error`): every
/// operation's error statuses refer to it.
#[cfg(feature = "openapi")]
pub struct ErrorReply;

#[cfg(feature = "openapi")]
impl<'s> utoipa::ToResponse<'s> for ErrorReply {
    fn response() -> (
        &'s str,
        utoipa::openapi::RefOr<utoipa::openapi::response::Response>,
    ) {
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let body = ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("Error")))
            .build();
        let reply = ResponseBuilder::new()
            .description("error")
            .content("application/json", body)
            .build();
        ("Error", reply.into())
    }
}

/// The JSON body of every error response: `{"code": "...", "message": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Error))]
#[error("{code:?}: {message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    /// Set when one node refused for lack of room (its admission): another node may take
    /// the request, so an apiserver places it elsewhere instead of failing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub node_refused: bool,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            node_refused: false,
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unavailable, message)
    }
    pub fn precondition(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::FailedPrecondition, message)
    }
    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unimplemented, message)
    }
    pub fn exhausted(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::ResourceExhausted, message)
    }
    /// This node has no room; another may (see [`ApiError::node_refused`]).
    pub fn node_full(message: impl Into<String>) -> Self {
        ApiError {
            node_refused: true,
            ..Self::new(ErrorCode::ResourceExhausted, message)
        }
    }
}

/// A system call or file operation that failed, with what was being done: the `Io`
/// variant the components' typed errors share, so `?` carries the cause (its errno for a
/// caller to match on) and the context together.
#[derive(Debug, thiserror::Error)]
#[error("{context}: {source}")]
pub struct IoFailure {
    pub context: String,
    #[source]
    pub source: std::io::Error,
}

impl IoFailure {
    pub fn new(context: impl Into<String>, source: std::io::Error) -> Self {
        IoFailure {
            context: context.into(),
            source,
        }
    }

    /// The last OS error (`errno`), for a raw system call that returned -1.
    pub fn last_os(context: impl Into<String>) -> Self {
        Self::new(context, std::io::Error::last_os_error())
    }

    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

/// `result.ctx(|| format!("opening {}", p.display()))?`: an I/O error with its context.
pub trait IoContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, IoFailure>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, IoFailure> {
        self.map_err(|source| IoFailure {
            context: context(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_serialises_as_code_and_message() {
        let e = ApiError::not_found("sandbox e0-abc does not exist");
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["code"], "not_found");
        assert_eq!(v["message"], "sandbox e0-abc does not exist");
        assert_eq!(e.code.http_status(), 404);
        let back: ApiError = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
    }
}
