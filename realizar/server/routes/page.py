"""``GET /``: the chat page, and ``GET /static/{name}``: its script and style files (``realizar/server/static/``,
plain files with no build step; ``serve --no-chat-page`` leaves both out).

The page is public, as ``/health`` is (the API key, when the server has one, guards the API calls the page makes,
which carry it: :mod:`realizar.server.auth`), and it calls the API of the server that served it, same-origin
(:mod:`realizar.server.origin` lets those through). Only the files of that folder are served, read once; each
answer carries a Content-Security-Policy that allows the page's own scripts, styles and API calls and nothing
else (no inline script, no other site), a second guard behind the page's escaping of model text.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import PurePosixPath

from fastapi import APIRouter
from fastapi.responses import Response

from realizar.server import protocol as P

__all__ = ["STATIC_PREFIX", "files", "router"]

STATIC_PREFIX = "/static/"

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # (revalidated each time: a newer realizar's page is picked up at once)
}


@cache
def files() -> dict[str, tuple[bytes, str]]:
    """Each file of ``realizar/server/static/`` whose kind is served: name -> (bytes, media type), read once (a
    RuntimeError when the page is missing)."""
    folder = resources.files("realizar.server") / "static"
    found = {}
    for item in folder.iterdir():
        kind = MEDIA_TYPES.get(PurePosixPath(item.name).suffix)
        if kind is not None and item.is_file():
            found[item.name] = (item.read_bytes(), kind)
    if "index.html" not in found:
        raise RuntimeError(f"the chat page's files are missing from {folder} (a broken install of realizar?)")
    return found


router = APIRouter()


def _answer(name: str) -> Response:
    body, kind = files()[name]
    return Response(body, media_type=kind, headers=HEADERS)


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def chat_page() -> Response:
    return _answer("index.html")


@router.api_route(STATIC_PREFIX + "{name}", methods=["GET", "HEAD"], include_in_schema=False)
async def static_file(name: str) -> Response:
    others = sorted(set(files()) - {"index.html"})
    if name not in others:
        raise P.ServerError(404, f"no static file {name!r}; there are {', '.join(others)}", code="not_found")
    return _answer(name)
