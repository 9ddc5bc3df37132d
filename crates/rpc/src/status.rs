//! The API's errors as gRPC statuses: the code of the same name, the message, and the whole
//! [`ApiError`] as a `dsec.v1.Error` in the status details, so a caller gets back exactly
//! what the edge answered (`node_refused` included). A status without those details did
//! not come from a handler: the call itself failed (connection, TLS, timeout).

use std::time::Duration;

use dsec_common::{ApiError, ErrorCode};
use prost::Message;
use tonic::{Code, Status};

use crate::pb;

/// Why a call got no answer from a handler, or the handler's refusal.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The callee answered with an API error.
    #[error("{}", .0.message)]
    Api(ApiError),
    /// The call failed on the way (connection refused, TLS refused, reset).
    #[error("{0}")]
    Transport(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The answer did not convert to the API's types.
    #[error("a malformed answer: {0}")]
    Malformed(#[from] crate::Malformed),
    /// The request could not be made here.
    #[error("{0}")]
    Local(String),
}

impl CallError {
    /// The error to answer a client with: the callee's own, or `unavailable` naming who
    /// did not answer.
    pub fn into_api(self, callee: &str) -> ApiError {
        match self {
            CallError::Api(e) => e,
            CallError::Local(m) => ApiError::internal(m),
            other => ApiError::unavailable(format!("{callee} does not answer ({other})")),
        }
    }
}

pub fn grpc_code(c: ErrorCode) -> Code {
    match c {
        ErrorCode::InvalidArgument => Code::InvalidArgument,
        ErrorCode::Unauthenticated => Code::Unauthenticated,
        ErrorCode::PermissionDenied => Code::PermissionDenied,
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::AlreadyExists => Code::AlreadyExists,
        ErrorCode::FailedPrecondition => Code::FailedPrecondition,
        ErrorCode::ResourceExhausted => Code::ResourceExhausted,
        ErrorCode::Unimplemented => Code::Unimplemented,
        ErrorCode::Unavailable => Code::Unavailable,
        ErrorCode::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorCode::Internal => Code::Internal,
    }
}

/// An API error as a status.
pub fn to_status(e: &ApiError) -> Status {
    let detail = pb::Error::from(e.clone()).encode_to_vec();
    Status::with_details(grpc_code(e.code), e.message.clone(), detail.into())
}

/// What a failed call means: the handler's API error (from the details), or a failure on
/// the way.
pub fn from_status(s: Status) -> CallError {
    if !s.details().is_empty()
        && let Ok(e) = pb::Error::decode(s.details())
        && let Ok(e) = ApiError::try_from(e)
    {
        return CallError::Api(e);
    }
    let detail = match std::error::Error::source(&s) {
        Some(cause) => format!("{}: {cause}", s.message()),
        None => s.message().to_string(),
    };
    CallError::Transport(format!("{:?}: {detail}", s.code()))
}

/// Awaits a call for at most `timeout`.
pub async fn within<T>(
    timeout: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, CallError> {
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Err(CallError::Timeout(timeout)),
        Ok(Err(s)) => Err(from_status(s)),
        Ok(Ok(r)) => Ok(r.into_inner()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_api_error_comes_back_whole_through_a_status() {
        for code in [
            ErrorCode::InvalidArgument,
            ErrorCode::NotFound,
            ErrorCode::ResourceExhausted,
            ErrorCode::Internal,
        ] {
            let mut e = ApiError::new(code, format!("a {code:?} refusal"));
            e.node_refused = code == ErrorCode::ResourceExhausted;
            let s = to_status(&e);
            assert_eq!(s.code(), grpc_code(code));
            match from_status(s) {
                CallError::Api(back) => assert_eq!(back, e),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_status_without_details_is_a_failure_on_the_way() {
        let s = Status::unavailable("connection refused");
        match from_status(s) {
            CallError::Transport(m) => assert!(m.contains("connection refused"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
