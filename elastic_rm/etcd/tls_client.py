"""aetcd's client with TLS: aetcd itself only opens plaintext channels.

Why a module of its own: it mirrors one method of aetcd (``Client.connect``, 1.0.0) with a secure channel,
a copy to re-check whenever aetcd is upgraded; the client facade (client.py) only constructs it.
"""

from __future__ import annotations

from typing import Any

import aetcd
import aetcd.exceptions as aexc
from aetcd import rpc

from .options import TlsOptions


class TlsAetcdClient(aetcd.Client):
    """aetcd.Client, with a TLS channel when ``tls`` is enabled."""

    def __init__(self, *args: Any, tls: TlsOptions | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._tls is None or not self._tls.enabled:
            return await super().connect()
        if self._connected.is_set():
            return
        # Mirrors aetcd.Client.connect (1.0.0), with a TLS channel instead of a plaintext one.
        target = f"{self._host}:{self._port}"
        self.channel = rpc.secure_channel(target, self._tls.credentials(), options=self._options.items())
        if self._username is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            request = rpc.AuthenticateRequest(name=self._username, password=self._password)
            try:
                resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
            except rpc.AioRpcError as exc:
                aexc._handle_exception(exc)
            self.metadata = (("token", resp.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()
