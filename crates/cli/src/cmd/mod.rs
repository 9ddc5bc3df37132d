pub mod certs;
pub mod commit;
pub mod gateway;
pub mod iam;
pub mod image;
pub mod pause;
pub mod role;
pub mod runtime;
pub mod sandbox;
pub mod snapshot;
pub mod up;

use anyhow::Result;

use crate::ApiArgs;
use crate::client::{self, Api};

/// An API client from the command's flags, the environment or the client config file.
pub fn api(a: &ApiArgs) -> Result<Api> {
    Api::new(&client::resolve(
        a.api_url.as_deref(),
        a.api_key.as_deref(),
        None,
    )?)
}
