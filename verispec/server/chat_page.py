"""The browser chat page at `/` (static files shipped in the package, no build step, no CDN) and
`GET /v1/verispec/info`, which tells the page what it is talking to.

The page and its assets are open even with `--api-key` (they hold no data); the page asks for the
key when /v1 answers 401. The info endpoint sits under /v1, so the key protects it like the rest.
"""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from verispec.server.errors import APIError
from verispec.server.state import ServerState

# Everything the page may load comes from this server; nothing inline, so no injected markup
# could run even if the page had a bug that let model text through as HTML.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".svg": "image/svg+xml", ".html": "text/html; charset=utf-8"}
# no-cache = revalidate every time: after an upgrade the browser never runs a stale page
ASSET_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
# What users call each proposer (GenerationStats.method / Proposer.method) in the page's header.
METHOD_LABELS = {"ar": "plain", "eagle3": "EAGLE3", "mtp": "MTP", "assistant": "assistant", "suffix": "suffix",
                 "ngram": "n-gram"}


def load_static_assets() -> dict[str, bytes]:
    """The shipped static files by name, read once (they are a few tens of KB)."""
    folder = resources.files("verispec.server") / "static"
    return {entry.name: entry.read_bytes() for entry in folder.iterdir()
            if entry.is_file() and _suffix(entry.name) in ASSET_TYPES}


def build_page_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    assets = load_static_assets()

    @router.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return Response(assets["index.html"], media_type=ASSET_TYPES[".html"],
                        headers={**ASSET_HEADERS, "Content-Security-Policy": PAGE_CSP})

    @router.get("/static/{name}", include_in_schema=False)
    async def static_asset(name: str) -> Response:
        if name not in assets:  # only the shipped names: no path is ever joined from the URL
            return APIError(404, f"no static file '{name}'").response()
        return Response(assets[name], media_type=ASSET_TYPES[_suffix(name)], headers=ASSET_HEADERS)

    @router.get("/v1/verispec/info")
    async def info() -> dict:
        return describe_server(state)

    return router


def describe_server(state: ServerState) -> dict:
    """Model, speculation method and device, for the page's header (and any curious client)."""
    info = state.engine.describe()
    return {
        "model": state.served_model_name,
        "method": info.method,
        "method_label": METHOD_LABELS.get(info.method, info.method),
        "num_drafts": info.num_drafts,
        "device": info.device,
        "device_name": info.device_name,
        "dtype": info.dtype,
        "numerics": info.numerics,
        "max_model_len": state.engine.max_model_len,
        "version": state.system_fingerprint,
    }


def _suffix(name: str) -> str:
    return name[name.rfind("."):] if "." in name else ""
