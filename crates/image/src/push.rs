//! Images to OCI distribution registries: [`push`] writes the image as an OCI image layout
//! ([`crate::archive::export`]: deterministic gzip layers, the config, the manifest) and
//! sends its blobs (those the registry has not got already) and then its manifest, so a
//! pull of the pushed reference gives back the same layers.

use std::path::Path;

use futures_util::StreamExt;
use oci_client::secrets::RegistryAuth;
use oci_client::{Reference, RegistryOperation};

use crate::oci::{Descriptor, Document, OCI_MANIFEST};
use crate::pull::{Credentials, PullFailure, PullRequest, client_for};
use crate::{ImageError, ImageRef, ImageStore, IoContext};

/// What a push did.
#[derive(Debug, Clone)]
pub struct Pushed {
    /// The manifest's digest in the registry.
    pub digest: String,
    pub pushed_blobs: usize,
    /// Blobs the registry had already.
    pub skipped_blobs: usize,
    pub pushed_bytes: u64,
    /// The digest of the lazy layers' artifact pushed with the image, if any.
    pub lazy_digest: Option<String>,
}

fn fail(reference: &str, kind: PullFailure, message: impl Into<String>) -> ImageError {
    ImageError::Pull {
        reference: reference.to_string(),
        kind,
        message: message.into(),
    }
}

fn reqwest_header(v: &'static str) -> http::HeaderValue {
    http::HeaderValue::from_static(v)
}

/// Sends the blob file at `path` as `digest`.
pub(crate) async fn send_blob(
    client: &oci_client::Client,
    r: &Reference,
    path: &Path,
    d: &Descriptor,
) -> Result<(), oci_client::errors::OciDistributionError> {
    let f = tokio::fs::File::open(path).await?;
    let stream = futures_util::stream::unfold(f, |mut f| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 1 << 20];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), f))
            }
            Err(e) => Some((Err(e.into()), f)),
        }
    })
    .boxed();
    client
        .push_blob_stream(r, stream, &d.digest, u64::try_from(d.size).ok())
        .await
        .map(|_| ())
}

/// Pushes image `image` of `store` to `dest` (`registry/repository:tag`); `how` gives the
/// credentials and transport (its `reference` and `target` are not used).
///
/// With `lazy`, the image's layers also go as EROFS images with their chunk tables, in
/// an artifact that refers to the image ([`crate::lazy`]), so that a node can start it
/// before it has arrived.
pub async fn push(
    store: &ImageStore,
    image: &ImageRef,
    dest: &str,
    how: &PullRequest,
    lazy: bool,
    log: &mut (dyn FnMut(String) + Send),
) -> Result<Pushed, ImageError> {
    let r: Reference = dest.parse().map_err(|e| {
        fail(
            dest,
            PullFailure::Invalid,
            format!("not an image reference ({e}); e.g. registry.example.com/team/env:v1"),
        )
    })?;
    if r.digest().is_some() {
        return Err(fail(
            dest,
            PullFailure::Invalid,
            "push to a tag, not a digest (the registry names the manifest's digest)",
        ));
    }
    let tmp = store.temp_dir("push")?;
    let _tmp = crate::pull::TempDir(tmp.clone());
    push_from(store, image, dest, &r, how, lazy, log, &tmp).await
}

#[allow(clippy::too_many_arguments)]
async fn push_from(
    store: &ImageStore,
    image: &ImageRef,
    dest: &str,
    r: &Reference,
    how: &PullRequest,
    lazy: bool,
    log: &mut (dyn FnMut(String) + Send),
    tmp: &Path,
) -> Result<Pushed, ImageError> {
    let layout = tmp.join("layout");
    let (store2, image2, layout2) = (store.clone(), image.clone(), layout.clone());
    let lines = tokio::task::spawn_blocking(move || {
        let mut l = Vec::new();
        // Without the store's `source`: it may name another project's sandbox.
        crate::archive::export_as(&store2, &image2, &layout2, &mut |s| l.push(s), false).map(|_| l)
    })
    .await
    .map_err(|e| ImageError::Build(format!("export worker failed: {e}")))??;
    for l in lines {
        log(l);
    }
    let blobs = layout.join("blobs/sha256");
    let read = |d: &str| -> Result<Vec<u8>, ImageError> {
        let p = blobs.join(d.trim_start_matches("sha256:"));
        std::fs::read(&p).ctx(|| format!("reading {}", p.display()))
    };
    let index: Document = serde_json::from_slice(
        &std::fs::read(layout.join("index.json")).ctx(|| "reading index.json".to_string())?,
    )
    .map_err(|e| ImageError::Corrupt(format!("the exported index: {e}")))?;
    let mdesc = index
        .manifests
        .as_deref()
        .and_then(<[Descriptor]>::first)
        .ok_or_else(|| ImageError::Corrupt("the exported index is empty".into()))?;
    let manifest_bytes = read(&mdesc.digest)?;
    let m: Document = serde_json::from_slice(&manifest_bytes)
        .map_err(|e| ImageError::Corrupt(format!("the exported manifest: {e}")))?;
    let (Some(config), Some(layers)) = (&m.config, &m.layers) else {
        return Err(ImageError::Corrupt(
            "the exported manifest has no config or no layers".into(),
        ));
    };
    let client = client_for(how)?;
    let auth = match &how.credentials {
        Credentials::Anonymous => RegistryAuth::Anonymous,
        Credentials::Basic { username, password } => {
            RegistryAuth::Basic(username.clone(), password.clone())
        }
        Credentials::Token(t) => RegistryAuth::Bearer(t.clone()),
    };
    let err = |e: oci_client::errors::OciDistributionError| crate::pull::registry_error(dest, e);
    client
        .auth(r, &auth, RegistryOperation::Push)
        .await
        .map_err(err)?;
    let mut out = Pushed {
        digest: mdesc.digest.clone(),
        pushed_blobs: 0,
        skipped_blobs: 0,
        pushed_bytes: 0,
        lazy_digest: None,
    };
    for d in std::iter::once(config).chain(layers) {
        if client.blob_exists(r, &d.digest).await.unwrap_or(false) {
            out.skipped_blobs += 1;
            log(format!("blob {}: in the registry already", d.digest));
            continue;
        }
        send_blob(
            &client,
            r,
            &blobs.join(d.digest.trim_start_matches("sha256:")),
            d,
        )
        .await
        .map_err(err)?;
        out.pushed_blobs += 1;
        out.pushed_bytes += u64::try_from(d.size).unwrap_or(0);
        log(format!(
            "blob {} ({}): {:.1} MiB sent",
            d.digest,
            d.media_type,
            d.size as f64 / (1 << 20) as f64
        ));
    }
    let subject = Descriptor {
        media_type: OCI_MANIFEST.to_string(),
        digest: mdesc.digest.clone(),
        size: manifest_bytes.len() as i64,
        platform: None,
        annotations: Default::default(),
        artifact_type: None,
    };
    client
        .push_manifest_raw(r, manifest_bytes, reqwest_header(OCI_MANIFEST))
        .await
        .map_err(err)?;
    log(format!("{dest} is {}", out.digest));
    if lazy {
        let (_, stored) = store.resolve(image)?;
        let sources: Vec<String> = layers.iter().map(|l| l.digest.clone()).collect();
        let published = crate::lazy::publish(
            store,
            &client,
            r,
            &stored.layers,
            &sources,
            &subject,
            tmp,
            log,
        )
        .await
        .map_err(|e| match e {
            crate::lazy::PublishError::Registry(e) => err(e),
            crate::lazy::PublishError::Image(e) => e,
        })?;
        out.pushed_blobs += published.pushed_blobs;
        out.skipped_blobs += published.skipped_blobs;
        out.pushed_bytes += published.pushed_bytes;
        out.lazy_digest = Some(published.digest);
    }
    Ok(out)
}
