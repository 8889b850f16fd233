"""``transferd doctor``'s discovery lines: can this machine reach the configured store?

For the embedded default there is nothing to reach.  For etcd: the etcd extra is
installed, the password file and TLS files load, and the store answers (as the
configured user, when there is one) within ``discovery.timeout_s``.  One
``(level, check, detail)`` per finding; a store that does not answer is FAIL
here, though the daemon itself starts and keeps trying without one.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from transferd.config_sections import ConfigError

if TYPE_CHECKING:
    from transferd.config import Config


class NotEtcd(Exception):
    """The store's port answers, with something that is not etcd's status reply."""


def discovery_checks(cfg: Config) -> list[tuple[str, str, str]]:
    d = cfg.discovery
    if not d.url:
        return [("ok", "discovery", "names in this daemon alone (discovery.url empty)")]
    from .service import make_backend

    try:
        backend = make_backend(d)
    except ConfigError as exc:
        return [("FAIL", "discovery", "; ".join(exc.errors))]
    client = backend.client  # type: ignore[attr-defined]

    async def probe() -> str:
        try:
            r = await asyncio.wait_for(client.status(), d.timeout_s * 2)
            if d.user:  # authenticated by then; reading our prefix checks the role
                await client.range(f"{d.prefix}/".encode(), limit=1)
        finally:
            client.close()
        version = r.get("version") if isinstance(r, dict) else None
        if not isinstance(version, str):  # what answers 200 there is not etcd's gateway
            raise NotEtcd(f"etcd at {d.url} does not answer as etcd: its status reply "
                          f"{str(r)[:80]!r} has no version (another program on that port?)")
        return version

    from .http import StoreError, Unavailable

    try:
        version = asyncio.run(probe())
    except NotEtcd as exc:
        return [("FAIL", "discovery", str(exc))]
    except (Unavailable, StoreError, TimeoutError, OSError) as exc:
        return [("FAIL", "discovery", f"etcd at {d.url} does not answer: {str(exc) or 'timed out'} "
                 "(the daemon would serve its own names and keep trying)")]
    who = f" as {d.user}" if d.user else ""
    return [("ok", "discovery", f"etcd {version} at {client.where}{who}, "
             f"prefix {d.prefix}")]
