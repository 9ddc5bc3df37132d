# SPDX-License-Identifier: Apache-2.0
"""Finding the API URL and key: arguments, environment, then client.toml."""

from __future__ import annotations

import os
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]


def default_config_path() -> Path | None:
    xdg = os.environ.get("XDG_CONFIG_HOME")
    if xdg:
        return Path(xdg) / "dsec" / "client.toml"
    home = os.environ.get("HOME")
    return Path(home) / ".config" / "dsec" / "client.toml" if home else None


def _read_toml(path: Path) -> dict:
    text = path.read_text()
    if tomllib is not None:
        return tomllib.loads(text)
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


def resolve(api_url: str | None, api_key: str | None) -> tuple[str, str]:
    url = api_url or os.environ.get("DSEC_API_URL")
    key = api_key or os.environ.get("DSEC_API_KEY")
    if url and key:
        return url.rstrip("/"), key
    env_path = os.environ.get("DSEC_CONFIG")
    path = Path(env_path) if env_path else default_config_path()
    if path is not None and path.exists():
        data = _read_toml(path)
        url = url or data.get("api_url")
        key = key or data.get("api_key")
    if not url or not key:
        where = path if path is not None else "~/.config/dsec/client.toml"
        raise ValueError(
            f"no OpenDsec API configured: run `dsec up` (it writes {where}), "
            "or set DSEC_API_URL and DSEC_API_KEY"
        )
    return url.rstrip("/"), key
