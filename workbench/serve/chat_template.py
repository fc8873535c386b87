"""The checkpoint's chat template, as ``workbench serve`` applies it to chat requests.

The template is a property of the checkpoint, like its tokenizer: it lives in the model layer,
:mod:`workbench.model.chat_template` (loading from a model folder, rendering as transformers
renders it, in a sandbox bounded in time and memory; a :class:`TemplateError` is answered as a 400
on ``messages``).  This module re-exports its names for the server (``state``, ``health``).
"""

from __future__ import annotations

from workbench.model import chat_template as _model
from workbench.model.chat_template import (  # noqa: F401 - re-exported for the server (__all__ below)
    GROWING_FILTERS,
    GROWING_METHODS,
    LINEAR_FILTERS,
    LINEAR_METHODS,
    MAX_BUILT_BYTES,
    MAX_CALL_DEPTH,
    MAX_OUTPUT_CHARS,
    MAX_TEMPLATE_BYTES,
    RENDER_SECONDS,
    ChatTemplate,
    TemplateError,
)

__all__ = list(_model.__all__)          # every name the model layer's module exports, and only those
