"""Whether W&B can reach its server: logged in (an API key) and not switched to offline. Kept apart
from loggers.py so that commands which do not train (`report`) can ask without importing Lightning."""

from __future__ import annotations

import netrc
import os
from pathlib import Path


def wandb_logged_in() -> bool:
    """True when wandb has an API key: WANDB_API_KEY or the ~/.netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        hosts = netrc.netrc(path).hosts if path.exists() else {}
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


def wandb_online() -> bool:
    """Logged in, and WANDB_MODE is not offline, dryrun or disabled."""
    return os.environ.get("WANDB_MODE", "") not in ("offline", "dryrun", "disabled") and wandb_logged_in()
