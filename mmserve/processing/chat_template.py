"""``--chat-template``: the Jinja template that renders chat messages in place of the
checkpoint's own, taken as vLLM takes it: the path of a file holding the template, or the
template's text itself.

Resolved and compiled once, at start-up, so that a missing file or a template that does not
parse stops the engine before its weights load, not at the first chat request.
"""

from __future__ import annotations

import os

SETTING = "chat_template (--chat-template)"
# Suffixes that make a value that is no file a missing template file rather than a template.
TEMPLATE_SUFFIXES = (".jinja", ".j2", ".txt")


def load_chat_template(setting: str | None) -> str | None:
    """The template text ``setting`` stands for; None (the checkpoint's own) for None.

    A value naming an existing file is read from it. Otherwise a value that looks like a path
    (no ``{`` and no line break, and a template file's suffix or a path separator) is a
    ``ValueError`` naming the missing file; any other value is the template itself. Either
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
    if "{" in value or "\n" in value:
        return False
    separators = {"/", os.sep, os.altsep} - {None}
    return (value.lower().endswith(TEMPLATE_SUFFIXES)
            or any(sep in value for sep in separators))


def _check_compiles(text: str, where: str) -> None:
    """Compile ``text`` in transformers' own environment for chat templates (which has tags,
    such as ``{% generation %}``, and filters that plain Jinja lacks); its compiled templates
    are cached, so rendering does not compile it again."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as e:
        line = getattr(e, "lineno", None)
        at = f" (line {line})" if line else ""
        raise ValueError(f"{SETTING}: {where} does not parse as a Jinja template{at}: "
                         f"{e.message or e}") from None
