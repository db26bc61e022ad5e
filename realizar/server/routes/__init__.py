"""The server's endpoints, one router per family; each takes the app's
:class:`~realizar.server.state.ServerState` as a dependency. ``PAGE_ROUTER`` (the chat page at ``/``) is
included unless the app is made without it."""

from realizar.server.routes import chat, completions, embeddings, health, messages, models, page, responses, tokenize

ROUTERS = (health.router, models.router, completions.router, chat.router, tokenize.router, messages.router,
           responses.router, embeddings.router)
PAGE_ROUTER = page.router

__all__ = ["PAGE_ROUTER", "ROUTERS"]
