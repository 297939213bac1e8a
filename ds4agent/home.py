"""Where the agent keeps its own files (config.toml, downloaded models): one small module, so the
CLI and `ds4-agent download` can both ask without importing each other."""
from __future__ import annotations

import os
from pathlib import Path


def agent_home() -> Path:
    h = os.environ.get("DS4_AGENT_HOME")
    return Path(h) if h else Path.home() / ".ds4-agent"
