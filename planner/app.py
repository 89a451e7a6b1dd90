"""Wiring: the planner's HTTP endpoints and its loop on one event loop.

- GET /metrics   Prometheus (planner/metrics.py)
- GET /keda      {"prefill": {"replicas": N}, "decode": {"replicas": M}}: KEDA's metrics-api
                 scaler reads `prefill.replicas` with targetValue 1, so the HPA it drives wants
                 exactly the planner's count
- GET /decision  the last decisions, newest last (why, what was observed and predicted)
- GET /healthz   200 while the loop runs (a hold is not unhealthy: it is the planner's answer)
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from planner.decide import ROLES
from planner.service import PlannerService
from planner.settings import PlannerSettings
from tandem_core.bus import conn

log = logging.getLogger("planner")


def create_app(settings: PlannerSettings, service: PlannerService | None = None) -> FastAPI:
    state: dict = {"svc": service}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        own = state["svc"] is None
        r = conn.connect(settings.redis) if own else None
        if own:
            state["svc"] = PlannerService(settings, r)
        stop = asyncio.Event()
        loop = asyncio.create_task(state["svc"].run(stop))
        state["loop"] = loop
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(loop, return_exceptions=True)
            if r is not None:
                await r.aclose()
            log.info("planner stopped")

    app = FastAPI(title="Tandem planner", version="0.1.0", lifespan=lifespan)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state["svc"].metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/keda")
    async def keda():
        d = state["svc"].last
        if d is None:
            return JSONResponse({"error": "no decision yet (the first interval has not ended)"}, status_code=503)
        return {r: {"replicas": d.replicas(r)} for r in ROLES} | {"held": d.held}

    @app.get("/decision")
    async def decision():
        return {"history": list(state["svc"].history)}

    @app.get("/healthz")
    async def healthz():
        loop = state.get("loop")
        if loop is None or loop.done():
            return JSONResponse({"status": "planner loop not running"}, status_code=503)
        return {"status": "ok"}

    return app
