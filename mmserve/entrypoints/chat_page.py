"""The chat page at ``GET /``: one static HTML page and its assets, shipped inside the package
(``static/``) and read with importlib.resources, so the page works on a server without internet
access and needs no build step.

The page and its assets, and nothing else, are public (``is_public``): with ``--api-key`` the
page asks for the key itself and sends it with every API call it makes.
"""

from __future__ import annotations

from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# Asset name -> content type; nothing else under static/ is served.
ASSETS = {
    "chat.css": "text/css; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
}
PAGE = "index.html"
PUBLIC_PATHS = frozenset({"/", *(f"/static/{name}" for name in ASSETS)})

# The page loads nothing but its own assets and talks only to this server; images it shows are
# the user's own attachments (data: URLs). Anything else is refused by the browser.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # revalidate, so an upgraded server's page is picked up
}


def is_public(path: str) -> bool:
    """Whether ``path`` is served without the API key."""
    return path in PUBLIC_PATHS


def read_asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def routes() -> list[Route]:
    """The page's routes; the files are read once, here."""
    page = read_asset(PAGE)
    assets = {name: (read_asset(name), kind) for name, kind in ASSETS.items()}

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            raise HTTPException(404, "Not Found")
        body, kind = assets[name]
        return Response(body, media_type=kind, headers=_HEADERS)

    return [Route("/", index, methods=["GET"]),
            Route("/static/{name}", asset, methods=["GET"])]
