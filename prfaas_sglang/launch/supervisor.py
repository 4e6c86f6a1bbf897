"""The launcher's role supervisor: ``/pd_role_switch`` for engines that cannot switch in place.

SGLang 0.5.15 has no ``/pd_role_switch`` (0.5.23 does). For a node with ``role_switch: restart``
the launcher does not exec the engine; it runs it as a child and serves upstream's endpoint
(``wire.role_switch``) on the node's ``switch_port``::

    router ── POST :switch_port/pd_role_switch {"new_role": "decode"} ──> supervisor
                                     idle? (the engine's /v1/loads: nothing running or waiting)
                                     SIGTERM the engine, wait; start the other role's command
                                     wait for the engine's /health ── 200 {"success": true, ...}

so the router's adapter is the same for both engines, pointed at this port instead of the
worker's (``router/conversion.py``); a bump to SGLang >= 0.5.23 turns the node into ``role_switch:
in-place`` and this process disappears.

Contract, upstream's: refused while the engine is busy (the caller drains first, nothing in flight
is touched) or while a switch runs; the same role is a no-op; an engine that does not come back
healthy within ``PRFAAS_ROLE_SWITCH_STARTUP_S`` leaves the node unhealthy (every later switch
refused, ``safe_to_restore`` false) until the supervisor is restarted. An engine that exits on its
own ends the supervisor with its exit status (whatever restarts nodes restarts this one).
With a deployment secret the endpoint wants the worker API key, as the engine's own do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable

import aiohttp
from aiohttp import web

from prfaas_sglang.adapters.http_auth import bearer_middleware
from prfaas_sglang.envs import envs
from prfaas_sglang.launch.command import LaunchCommand
from prfaas_sglang.roles import ROLE_SPECS, Role
from prfaas_sglang.router.workers import FactsError, parse_loads
from prfaas_sglang.wire.auth import AuthError, DeploymentKeys
from prfaas_sglang.wire.role_switch import RoleSwitchReply, RoleSwitchRequest

logger = logging.getLogger("prfaas.supervisor")

MODE_ROLE = {"prefill": Role.PD_PREFILL, "decode": Role.PD_DECODE}


class Supervisor:
    """One engine child and the endpoint that restarts it in the other PD role.

    ``command_for(role)`` builds the engine's command for ``role`` (the launcher's ``make_command``
    with the role replaced); ``engine_url`` is where the engine serves HTTP.
    """

    def __init__(self, command_for: Callable[[Role], LaunchCommand], role: Role, engine_url: str,
                 keys: DeploymentKeys | None = None, startup_s: float | None = None, stop_grace_s: float = 30.0):
        self.command_for, self.role, self.engine_url, self.keys = command_for, role, engine_url.rstrip("/"), keys
        self.startup_s = startup_s if startup_s is not None else float(envs.ROLE_SWITCH_STARTUP_S.get())
        self.stop_grace_s = stop_grace_s
        self.child: asyncio.subprocess.Process | None = None
        self.unhealthy: str | None = None
        self._lock = asyncio.Lock()
        self._expected_exit = False

    @property
    def mode(self) -> str:
        return ROLE_SPECS[self.role].disaggregation_mode

    async def start_child(self) -> None:
        command = self.command_for(self.role)
        self.child = await asyncio.create_subprocess_exec(*command.argv, env={**os.environ, **command.env})
        logger.info("engine started as %s (pid %d): %s", self.role.value, self.child.pid, " ".join(command.argv))

    async def stop_child(self) -> None:
        child, self.child = self.child, None
        if child is None or child.returncode is not None:
            return
        child.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(child.wait(), self.stop_grace_s)
        except asyncio.TimeoutError:
            child.kill()
            await child.wait()

    async def _engine_json(self, session: aiohttp.ClientSession, path: str):
        async with session.get(self.engine_url + path, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status, (await resp.json(content_type=None) if resp.status == 200 else None)

    async def _busy(self, session: aiohttp.ClientSession) -> str | None:
        """Why the engine is not idle (None: idle), from its ``/v1/loads``."""
        try:
            status, body = await self._engine_json(session, "/v1/loads")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            return f"its /v1/loads cannot be read ({err or type(err).__name__})"
        if status != 200:
            return f"its /v1/loads answered {status}"
        try:
            load = parse_loads(body)
        except FactsError as err:
            return f"its /v1/loads is malformed ({err})"
        return f"{load.running} running, {load.waiting} waiting" if load.running or load.waiting else None

    async def _wait_healthy(self, session: aiohttp.ClientSession) -> bool:
        deadline = asyncio.get_running_loop().time() + self.startup_s
        while asyncio.get_running_loop().time() < deadline:
            if self.child is None or self.child.returncode is not None:
                return False
            try:
                if (await self._engine_json(session, "/health"))[0] == 200:
                    return True
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass
            await asyncio.sleep(0.5)
        return False

    async def switch(self, new_mode: str, session: aiohttp.ClientSession) -> RoleSwitchReply:
        old = self.mode
        if self.unhealthy is not None:
            return RoleSwitchReply(False, f"instance unhealthy ({self.unhealthy}); restart required", old, safe_to_restore=False)
        if self._lock.locked():
            return RoleSwitchReply(False, "a role switch is already in progress", old)
        async with self._lock:
            if new_mode == old:
                return RoleSwitchReply(True, "already in target role", old, new_mode)
            if (busy := await self._busy(session)) is not None:
                return RoleSwitchReply(False, f"instance is not idle ({busy}); drain it first", old)
            self._expected_exit = True
            await self.stop_child()
            self.role = MODE_ROLE[new_mode]
            try:
                await self.start_child()
                healthy = await self._wait_healthy(session)
            except OSError as err:
                healthy, self.unhealthy = False, f"restarting as {new_mode} failed: {err}"
            finally:
                self._expected_exit = False
            if not healthy:
                self.unhealthy = self.unhealthy or f"the engine did not come back healthy as {new_mode} within {self.startup_s:g} s"
                return RoleSwitchReply(False, f"{self.unhealthy}; the instance is unhealthy, restart required", old, new_mode,
                                       safe_to_restore=False)
            return RoleSwitchReply(True, f"restarted as {new_mode}", old, new_mode)

    def app(self, session_key: web.AppKey) -> web.Application:
        def reject(err: AuthError) -> web.Response:
            return web.json_response(RoleSwitchReply(False, str(err), self.mode).to_json(), status=401)

        app = web.Application(client_max_size=1 << 16,
                              middlewares=[bearer_middleware(self.keys.worker_api_key if self.keys else None, reject)])

        async def health(request):
            alive = self.child is not None and self.child.returncode is None and self.unhealthy is None
            return web.json_response({"role": self.role.value, "unhealthy": self.unhealthy}, status=200 if alive else 503)

        async def role_switch(request):
            try:
                wanted = RoleSwitchRequest.decode(await request.read())
            except ValueError as err:
                reply = RoleSwitchReply(False, str(err), self.mode)
            else:
                reply = await self.switch(wanted.new_role, request.app[session_key])
            return web.json_response(reply.to_json(), status=reply.http_status)

        app.router.add_get("/health", health)
        app.router.add_post("/pd_role_switch", role_switch)
        return app

    async def run(self, host: str, port: int) -> int:
        """Serve until SIGTERM/SIGINT (the engine is stopped too) or until the engine exits on its own
        (returns its exit status)."""
        session_key = web.AppKey("session", aiohttp.ClientSession)
        app = self.app(session_key)
        headers = self.keys.bearer() if self.keys else None
        async with aiohttp.ClientSession(headers=headers) as session:
            app[session_key] = session
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await self.start_child()
            try:
                while not stop.is_set():
                    child = self.child
                    if child is not None and child.returncode is not None and not self._expected_exit:
                        logger.error("engine exited on its own with status %s", child.returncode)
                        return child.returncode or 1
                    try:
                        await asyncio.wait_for(stop.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
                return 0
            finally:
                await self.stop_child()
                await runner.cleanup()


def supervise(command_for: Callable[[Role], LaunchCommand], role: Role, engine_url: str, host: str, port: int,
              keys: DeploymentKeys | None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s supervisor %(levelname)s %(message)s")
    return asyncio.run(Supervisor(command_for, role, engine_url, keys).run(host, port))
