"""A checkpoint's own chat template, applied as transformers applies it.

A model folder may carry a Jinja chat template: ``chat_template`` in ``tokenizer_config.json``
(a string, or a list of ``{"name", "template"}`` of which ``default`` is used), or a
``chat_template.jinja`` file (which wins, as in transformers).  It is rendered the way
``PreTrainedTokenizerBase.apply_chat_template`` renders it: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``
(true: the prompt ends where the assistant's answer begins) and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...), the helpers ``raise_exception`` and ``strftime_now``,
``tojson`` with its keyword arguments, and the ``{% generation %}`` tag (its body).  Text parts
of a message (``"content": [{"type": "text", ...}]``) reach the template as the list they are.
The rendered text already holds any BOS the template writes, so it is tokenized without the
tokenizer's own special tokens (``add_special_tokens=False``), again as transformers does.

A template that raises (``raise_exception("roles must alternate")``) gives a :class:`TemplateError`
with its message: the server answers it as a 400 on ``messages``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from workbench.errors import WorkbenchError


class TemplateError(WorkbenchError):
    """The template refused these messages, or could not be rendered."""


_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(v) -> str | None:
    if isinstance(v, dict):                       # {"content": "<s>", "lstrip": ..., ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def _generation_extension():
    from jinja2.ext import Extension

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens
        with it (for training masks); rendering a prompt, it is its body."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str], origin: str) -> None:
        from jinja2.exceptions import TemplateError as JinjaError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(str(message))

        _Generation = _generation_extension()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _Generation])

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except JinjaError as e:
            raise TemplateError(f"{origin}: the chat template does not parse: {e}") from None
        self.source, self.special, self.origin = source, special, origin
        self._jinja_error = JinjaError

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ChatTemplate | None":
        """The folder's template, or None when it has none."""
        folder = Path(folder)
        cfg_file = folder / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        except (OSError, ValueError) as e:
            raise TemplateError(f"{cfg_file}: cannot read it ({e})") from None
        special = {k: t for k in _SPECIAL if (t := _token_text(cfg.get(k))) is not None}
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):                 # named templates: the default one
            tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(tpl, str) or not tpl.strip():
            return None
        return cls(tpl, special, f"{cfg_file}: chat_template")

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special)
        except TemplateError:
            raise
        except self._jinja_error as e:
            raise TemplateError(f"the model's chat template failed on these messages: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template bug (e.g. a missing key) is still the template's
            raise TemplateError(f"the model's chat template failed on these messages: "
                                f"{type(e).__name__}: {e}") from None
