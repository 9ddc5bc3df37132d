//! The edge's control API as gRPC (`dsec.v1.Edge`, `proto/dsec/v1/cluster.proto`), served on
//! an edge's cluster listener next to the REST routes. Callers are cluster components, by
//! their certificate: an apiserver may make every call for the principal it names in the
//! `x-dsec-principal` metadata; the watcher may ask for the status only. Each call makes
//! the same checks as its REST route (visibility by project, the create's project and
//! image, volumes) and answers with the same errors, as gRPC statuses.

use dsec_common::ApiError;
use dsec_common::api::{
    CreateSandboxRequest, ForkRequest, GroupRequest, ListSandboxesResponse, ListSnapshotsResponse,
    PauseRequest, ResumeRequest,
};
use dsec_iam::Principal;
use dsec_iam::http::{check_create, decode_principal};
use dsec_mtls::{Identity, Role};
use dsec_rpc::pb::edge_server::{Edge as EdgeRpc, EdgeServer};
use dsec_rpc::{PRINCIPAL_METADATA, pb, to_status};
use tonic::{Request, Response, Status};

use crate::{
    AppState, create_checked, group_ids, resume_to, sandboxes_seen_by, status_seen_by, visible,
};

/// The `dsec.v1.Edge` service over `st` (whose `forwarded` must be set: a cluster listener).
pub fn service(st: AppState) -> EdgeServer<Service> {
    EdgeServer::new(Service { st })
}

pub struct Service {
    st: AppState,
}

type Answer<T> = Result<Response<T>, Status>;

fn refuse(e: ApiError) -> Status {
    to_status(&e)
}

fn fail(f: dsec_common::http::Failure) -> Status {
    to_status(&f.0)
}

/// The caller a request acts for, when its certificate may name one for this call.
fn caller<T>(st: &AppState, req: &Request<T>, status_only: bool) -> Result<Principal, Status> {
    if !st.forwarded {
        return Err(Status::permission_denied(
            "this listener does not take calls from cluster components",
        ));
    }
    let role = req.extensions().get::<Identity>().map(|i| i.role);
    match role {
        Some(Role::Apiserver) => {}
        Some(Role::Watcher) if status_only => {}
        Some(r) => {
            return Err(Status::permission_denied(format!(
                "a {r} certificate may not make this call"
            )));
        }
        None => {
            return Err(Status::unauthenticated(
                "no cluster certificate on this connection",
            ));
        }
    }
    req.metadata()
        .get(PRINCIPAL_METADATA)
        .and_then(|v| v.to_str().ok())
        .and_then(decode_principal)
        .ok_or_else(|| {
            Status::unauthenticated(format!(
                "the call names no caller: set {PRINCIPAL_METADATA} to the principal it acts for"
            ))
        })
}

fn sandbox(info: dsec_common::api::SandboxInfo) -> Response<pb::Sandbox> {
    Response::new(info.into())
}

#[tonic::async_trait]
impl EdgeRpc for Service {
    async fn status(&self, req: Request<pb::StatusRequest>) -> Answer<pb::NodeStatus> {
        let p = caller(&self.st, &req, true)?;
        let node = status_seen_by(&self.st, &p)
            .nodes
            .into_iter()
            .next()
            .ok_or_else(|| Status::internal("the edge reported no status"))?;
        Ok(Response::new(node.into()))
    }

    async fn create(&self, req: Request<pb::CreateCall>) -> Answer<pb::Sandbox> {
        let p = caller(&self.st, &req, false)?;
        let call = req
            .into_inner()
            .request
            .ok_or_else(|| Status::invalid_argument("the create names no request"))?;
        let create = check_create(CreateSandboxRequest::from(call), &p).map_err(fail)?;
        let info = create_checked(&self.st, &p, create).await.map_err(fail)?;
        Ok(sandbox(info))
    }

    async fn list(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Answer<pb::ListSandboxesResponse> {
        let p = caller(&self.st, &req, false)?;
        let sandboxes = sandboxes_seen_by(&self.st, &p, &req.into_inner().labels);
        Ok(Response::new(ListSandboxesResponse { sandboxes }.into()))
    }

    async fn stop(&self, req: Request<pb::SandboxRef>) -> Answer<pb::Empty> {
        let p = caller(&self.st, &req, false)?;
        let id = req.into_inner().id;
        visible(&self.st, &p, &id).map_err(fail)?;
        self.st.edge.stop(&id).await.map_err(refuse)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn fork(&self, req: Request<pb::ForkCall>) -> Answer<pb::ForkResponse> {
        let p = caller(&self.st, &req, false)?;
        let call = req.into_inner();
        visible(&self.st, &p, &call.id).map_err(fail)?;
        let fork = call
            .request
            .map(ForkRequest::from)
            .ok_or_else(|| Status::invalid_argument("the fork names no request"))?;
        let answer = self.st.edge.fork(&call.id, fork).await.map_err(refuse)?;
        Ok(Response::new(answer.into()))
    }

    async fn pause(&self, req: Request<pb::PauseCall>) -> Answer<pb::Sandbox> {
        let p = caller(&self.st, &req, false)?;
        let call = req.into_inner();
        visible(&self.st, &p, &call.id).map_err(fail)?;
        let pause = call.request.map(PauseRequest::from).unwrap_or_default();
        let info = self
            .st
            .edge
            .pause(&call.id, pause.to_disk)
            .await
            .map_err(refuse)?;
        Ok(sandbox(info))
    }

    async fn resume(&self, req: Request<pb::ResumeCall>) -> Answer<pb::Sandbox> {
        let p = caller(&self.st, &req, false)?;
        let call = req.into_inner();
        visible(&self.st, &p, &call.id).map_err(fail)?;
        let resume = call.request.map(ResumeRequest::from).unwrap_or_default();
        let info = resume_to(&self.st, &call.id, resume)
            .await
            .map_err(refuse)?;
        Ok(sandbox(info))
    }

    async fn group(&self, req: Request<pb::GroupCall>) -> Answer<pb::GroupResponse> {
        let p = caller(&self.st, &req, false)?;
        let call = req.into_inner();
        let group = call
            .request
            .map(GroupRequest::from)
            .ok_or_else(|| Status::invalid_argument("the group call names no request"))?;
        let ids = group_ids(&self.st, &p, &group).map_err(fail)?;
        let to_disk = group.to_disk && !call.resume;
        let done = self.st.edge.group(ids, to_disk, call.resume).await;
        Ok(Response::new(done.into()))
    }

    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Answer<pb::ListSnapshotsResponse> {
        let p = caller(&self.st, &req, false)?;
        let mut snapshots = self.st.edge.list_snapshots();
        snapshots.retain(|s| dsec_iam::within(&s.project, &p.project));
        Ok(Response::new(ListSnapshotsResponse { snapshots }.into()))
    }
}
