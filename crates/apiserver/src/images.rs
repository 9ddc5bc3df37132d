//! Images belong to projects: a reference's namespace (`root/t1` in `root/t1/env:v1`) is
//! the project that owns it. A key reads images of its project subtree and of its
//! ancestors (so `root/…` base images are shared), and writes only inside its subtree
//! (see [`Principal::may_read_images`] and [`Principal::may_write_images`]). The checks
//! sit in the edge's router, which a cluster's apiservers forward to with the caller's
//! principal, so both paths enforce them.

use dsec_common::{ApiError, ErrorCode};
use dsec_iam::Principal;
use dsec_image::build::BuildSpec;
use dsec_image::{ImageRef, store::ImageEntry};

use crate::ApiResult;

/// The image a create names, as the caller may see it: an image of a project it cannot
/// read does not exist for it (404, the same answer as a missing image, so names of other
/// projects' images don't leak). A reference that does not parse is left to the edge,
/// which says what is wrong with it.
pub(crate) fn check_read(p: &Principal, image: &str) -> ApiResult<()> {
    let Ok(r) = ImageRef::parse(image) else {
        return Ok(());
    };
    if p.may_read_images(&r.project()) {
        return Ok(());
    }
    Err(ApiError::not_found(format!(
        "image {r} not found; this key (project {}) can use images of its project, the projects inside it and its parents, e.g. root/base",
        p.project
    ))
    .into())
}

/// A commit's (or any other write's) target: 403 naming where the key may write.
pub(crate) fn check_write(p: &Principal, image: &str) -> ApiResult<ImageRef> {
    let r = ImageRef::parse(image).map_err(|e| ApiError::invalid(e.to_string()))?;
    let project = r.project();
    if p.may_write_images(&project) {
        return Ok(r);
    }
    let name = r.repo.last().map(String::as_str).unwrap_or("name");
    Err(ApiError::new(
        ErrorCode::PermissionDenied,
        format!(
            "image {r} belongs to project {project}; this key (project {}) may create or replace images only in its own project and those inside it, e.g. {}/{name}:{}",
            p.project, p.project, r.tag
        ),
    )
    .into())
}

/// A build sent over the API: its image in the caller's subtree, its base one it may read,
/// and nothing that names a file of the node (`src`, `copy_from`: send `content`).
pub(crate) fn check_build(p: &Principal, spec: &BuildSpec) -> ApiResult<()> {
    spec.validate()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    check_write(p, &spec.name)?;
    if let Some(from) = &spec.from {
        check_read(p, from)?;
    }
    if let Some(i) = spec
        .steps
        .iter()
        .position(|s| s.src.is_some() || s.copy_from.is_some())
    {
        return Err(ApiError::invalid(format!(
            "step {}: `src` and `copy_from` name files of the machine that reads the spec; over the API send the file's `content` (`dsec image build` reads `src` files for you)",
            i + 1
        ))
        .into());
    }
    Ok(())
}

/// The images of a listing the caller may read. Of images it reads but does not own (its
/// parents'), a commit's source is withheld: it names a sandbox of another project.
pub(crate) fn visible(p: &Principal, mut list: Vec<ImageEntry>) -> Vec<ImageEntry> {
    list.retain(|i| ImageRef::parse(&i.reference).is_ok_and(|r| p.may_read_images(&r.project())));
    for i in &mut list {
        let owned = ImageRef::parse(&i.reference).is_ok_and(|r| p.may_write_images(&r.project()));
        if !owned && i.manifest.source.starts_with("commit") {
            i.manifest.source = "commit".into();
        }
    }
    list
}

#[cfg(test)]
mod tests {
    use dsec_iam::PrincipalKind;

    use super::*;

    fn key(project: &str) -> Principal {
        Principal {
            name: "eve".into(),
            kind: PrincipalKind::Agent,
            key_id: "k".into(),
            project: project.into(),
        }
    }

    #[test]
    fn a_tenant_cannot_replace_a_shared_image_and_is_told_where_it_may_write() {
        let e = check_write(&key("root/t1"), "root/py:3.11").unwrap_err().0;
        assert_eq!(e.code, ErrorCode::PermissionDenied);
        assert!(e.message.contains("root/t1/py:3.11"), "{}", e.message);
        assert_eq!(
            check_write(&key("root/t1"), "root/t1/env")
                .unwrap()
                .to_string(),
            "root/t1/env:latest"
        );
        assert_eq!(
            check_write(&key("root/t1"), "../x").unwrap_err().0.code,
            ErrorCode::InvalidArgument
        );
    }

    #[test]
    fn a_build_writes_only_the_callers_images_from_bases_it_reads() {
        let spec = |t: &str| BuildSpec::parse(t).unwrap();
        let eve = key("root/t1");
        let ok = spec("name = \"root/t1/env:1\"\nfrom = \"root/base\"\n[[step]]\nrun = \"true\"\n");
        assert!(check_build(&eve, &ok).is_ok());
        let over = spec("name = \"root/base\"\nfrom = \"root/base\"\n");
        assert_eq!(
            check_build(&eve, &over).unwrap_err().0.code,
            ErrorCode::PermissionDenied
        );
        let theirs = spec("name = \"root/t1/x\"\nfrom = \"root/t2/secret:1\"\n");
        assert_eq!(
            check_build(&eve, &theirs).unwrap_err().0.code,
            ErrorCode::NotFound
        );
        let host = spec(
            "name = \"root/t1/x\"\nfrom = \"root/base\"\n[[step]]\nfile = \"/s\"\ncopy_from = \"/etc\"\n",
        );
        let e = check_build(&eve, &host).unwrap_err().0;
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        assert!(e.message.contains("copy_from"), "{}", e.message);
    }

    #[test]
    fn a_siblings_image_does_not_exist_for_a_tenant() {
        let e = check_read(&key("root/t1"), "root/t2/env:v1").unwrap_err().0;
        assert_eq!(e.code, ErrorCode::NotFound);
        assert!(check_read(&key("root/t1"), "root/py:3.11").is_ok());
        assert!(check_read(&key("root/t1"), "root/t1/x/env:v1").is_ok());
    }
}
