"""The API's interactive docs, with Swagger UI's own files served from this host: the page works
on a fleet's private network, with no CDN in reach (FastAPI's default page loads them from one)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles


def mount_api_docs(app: FastAPI, docs_url: str, openapi_url: str) -> None:
    """`docs_url` serves the page and `docs_url/assets/` the files it loads."""
    from swagger_ui_bundle import swagger_ui_path

    assets = f"{docs_url}/assets"
    app.mount(assets, StaticFiles(directory=str(swagger_ui_path)), name="api-docs-assets")

    @app.get(docs_url, include_in_schema=False)
    async def api_docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - API docs",
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon-32x32.png",
        )
