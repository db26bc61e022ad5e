"""Text: tokenizers (a facade over the ``tokenizers`` library, built from GGUF metadata or a
``tokenizer.json``) and chat templates."""

from realizar.text.chat import CHATML_TEMPLATE, ChatTemplateError, render_chat
from realizar.text.tokenizer import StreamDecoder, Tokenizer

__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "StreamDecoder", "Tokenizer", "render_chat"]
