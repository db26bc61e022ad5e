"""The server's endpoints, one router per family; each takes the app's
:class:`~realizar.server.state.ServerState` as a dependency."""

from realizar.server.routes import chat, completions, embeddings, health, messages, models, responses, tokenize

ROUTERS = (health.router, models.router, completions.router, chat.router, tokenize.router, messages.router,
           responses.router, embeddings.router)

__all__ = ["ROUTERS"]
