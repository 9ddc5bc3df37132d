//! The client configuration file (`client.toml`) that `dsec up` writes and the CLI and
//! SDKs read: `$DSEC_CONFIG`, else `~/.config/dsec/client.toml`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientConfig {
    pub api_url: String,
    pub api_key: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read client config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("client config {path} is not valid: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
}

/// `~/.config/dsec/client.toml` (honouring `XDG_CONFIG_HOME`).
pub fn default_path() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|s| !s.is_empty()) {
        return Some(PathBuf::from(x).join("dsec/client.toml"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config/dsec/client.toml"))
}

/// The file a client should read: `$DSEC_CONFIG` if set, else the default location.
pub fn resolve_path() -> Option<PathBuf> {
    std::env::var_os("DSEC_CONFIG")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .or_else(default_path)
}

impl ClientConfig {
    pub fn load(path: &Path) -> Result<ClientConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn to_toml(&self) -> String {
        format!(
            "# Written by `dsec up`. Read by the dsec CLI and the SDKs.\napi_url = {}\napi_key = {}\n",
            toml_str(&self.api_url),
            toml_str(&self.api_key)
        )
    }
}

fn toml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_toml() {
        let c = ClientConfig {
            api_url: "http://127.0.0.1:7600".into(),
            api_key: "dsk.abc\"def".into(),
        };
        let dir = std::env::temp_dir().join(format!("dsec-cc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("client.toml");
        std::fs::write(&p, c.to_toml()).unwrap();
        assert_eq!(ClientConfig::load(&p).unwrap(), c);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
