"""``--chat-template``: the Jinja template that renders chat messages in place of the
checkpoint's own, taken as vLLM takes it: the path of a file holding the template, or the
template's text itself.

Resolved and compiled once, at start-up, so that a missing file or a template that does not
parse stops the engine before its weights load, not at the first chat request.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mmserve.errors import InvalidInputError

SETTING = "chat_template (--chat-template)"


def load_chat_template(setting: str | None) -> str | None:
    """The template text ``setting`` stands for; None (the checkpoint's own) for None.

    A value naming an existing file is read from it. Otherwise a value with none of ``{``,
    ``}`` and a line break, which no useful template lacks, is a ``ValueError`` naming the
    missing file (vLLM's rule); any other value is the template itself. Either
    way the template is compiled as transformers renders it, and one that does not parse is a
    ``ValueError`` saying where."""
    if setting is None:
        return None
    if os.path.exists(setting):
        try:
            with open(setting, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{SETTING}: cannot read the template file {setting!r}: "
                             f"{e}") from None
        where = f"the template in {setting!r}"
    elif _looks_like_path(setting):
        raise ValueError(
            f"{SETTING}: no template file {setting!r} (looked for "
            f"{os.path.abspath(setting)!r}); give an existing file, or the template's text "
            "itself.")
    else:
        text, where = setting, "the template given as text"
    if not text.strip():
        raise ValueError(f"{SETTING}: {where} is empty; every chat would render as nothing.")
    _check_compiles(text, where)
    return text


def _looks_like_path(value: str) -> bool:
    return not any(c in value for c in "{}\n")


def _check_compiles(text: str, where: str) -> None:
    """Compile ``text`` in transformers' own environment for chat templates (which has tags,
    such as ``{% generation %}``, and filters that plain Jinja lacks); its compiled templates
    are cached, so rendering does not compile it again."""
    import jinja2

    try:  # transformers' own (private) compiler: its environment, its cache
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: the first chat finds what does not parse
        return
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as e:
        line = getattr(e, "lineno", None)
        at = f" (line {line})" if line else ""
        raise ValueError(f"{SETTING}: {where} does not parse as a Jinja template{at}: "
                         f"{e.message or e}") from None


def content_format(template: str | None, setting: str = "auto") -> str:
    """How a template takes each message's content, vLLM's two forms: "openai", a list of
    parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``), as the templates of
    vision-language checkpoints take it; or "string", the text alone, as text models'
    templates (Qwen2.5's, Hermes') do. ``setting`` "auto" tells them apart by whether the
    template loops over a message's content anywhere (directly, or through a variable set
    to it)."""
    if setting != "auto":
        return setting
    if template is None:
        return "openai"
    try:
        import jinja2.nodes as nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001 (a template we cannot read: leave it the parts)
        return "openai"
    aliases = {node.target.name for node in tree.find_all(nodes.Assign)
               if isinstance(node.target, nodes.Name) and _is_content(node.node)}
    for loop in tree.find_all(nodes.For):
        if _is_content(loop.iter) or (isinstance(loop.iter, nodes.Name)
                                      and loop.iter.name in aliases):
            return "openai"
    return "string"


def _is_content(node: object) -> bool:
    """Whether ``node`` reads a message's ``content`` (``m.content``, ``m['content']``, under
    any filters)."""
    import jinja2.nodes as nodes

    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
            and node.arg.value == "content")


# Names a request's chat_template_kwargs may not use: the renderer's own arguments and the
# processor's (which transformers would take for itself), and the template's built-ins.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "chat_template", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs", "images", "videos", "audio", "text", "padding",
    "truncation", "max_length", "return_tensors", "add_special_tokens", "bos_token",
    "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now", "sampling_rate",
    "num_frames", "video_fps", "do_sample_frames", "load_audio_from_video"})
MAX_TEMPLATE_KWARGS_CHARS = 65_536


def template_kwargs(value: Any) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: more variables for the template (Qwen3's
    ``enable_thinking``, say), checked: an object of names that are identifiers and none of
    the renderer's own, at most 64 KiB as JSON, nested at most 64 levels."""
    from mmserve.processing.chat_tools import check_nesting

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputError("'chat_template_kwargs' must be an object of the template's "
                                "variables", param="chat_template_kwargs")
    for name in value:
        if not (isinstance(name, str) and name.isidentifier()) or name in RESERVED_TEMPLATE_KWARGS:
            raise InvalidInputError(
                f"chat_template_kwargs may not set {str(name)[:40]!r}: names must be "
                "identifiers, and not the renderer's own (messages, tools, "
                "add_generation_prompt, ...: those have fields of their own)",
                param="chat_template_kwargs")
    check_nesting(value, "chat_template_kwargs")
    if len(json.dumps(value, default=str)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidInputError(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_CHARS} "
                                "characters as JSON", param="chat_template_kwargs")
    return value
