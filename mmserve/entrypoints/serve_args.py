"""``mmserve serve``'s command line and front-door settings (``ServerConfig``), apart from
the server itself (``api_server.py``, which the command imports only to serve): building the
``mmserve`` command's parser loads no engine, and neither does a process that imports the
command again, as each tensor-parallel worker does when started by spawning it."""

from __future__ import annotations

import argparse
import json
import os
import ssl
from dataclasses import dataclass, field

from mmserve.entrypoints.engine_args import add_engine_args
from mmserve.entrypoints.media import MediaPolicy
from mmserve.entrypoints.tool_calls import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ServerConfig:
    """Front-door settings; the engine has its own ``EngineConfig``."""

    served_model_name: str  # the id answers report
    api_key: str | None = None
    max_queue: int | None = 1024  # requests waiting beyond the max_num_seqs running ones
    max_request_body_bytes: int = 32 * 1024 * 1024
    media: MediaPolicy = field(default_factory=MediaPolicy)
    header_timeout_s: float = 10.0  # from a request's first byte to its last header
    body_timeout_s: float = 60.0  # to read a whole request body
    shutdown_timeout_s: float = 30.0  # SIGTERM: drain this long, then abort what is left
    # The engine in a process of its own (core_process.py), else on a thread of the server's;
    # None: in a process of its own where it runs on a GPU.
    engine_process: bool | None = None
    # Tool calls: the parser of the model's own call format, and whether "auto" tool choice
    # (the model decides, the parser reads its calls) is on; both vLLM's settings.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # vLLM's: log-probabilities name tokens "token_id:N" unless a request says otherwise.
    return_tokens_as_token_ids: bool = False
    # Browsers on these origins may call the API (CORS; none by default, "*" any), with these
    # methods and headers, and credentials where allowed; vLLM's flags.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # HTTPS: the certificate and its key (PEM files), and for client certificates the CA
    # file and whether they are required (``ssl.CERT_NONE``, ``CERT_OPTIONAL`` or
    # ``CERT_REQUIRED``: 0, 1, 2).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # vLLM's: chat requests may send images as their embeddings (``image_embeds`` parts).
    enable_mm_embeds: bool = False
    # More ids requests may name for the model (vLLM's several --served-model-name).
    model_aliases: tuple[str, ...] = ()
    # The Responses API's stored responses, at most this many bytes of JSON (0: none kept).
    responses_store_bytes: int = 64 * 1024 * 1024
    # The Files API's files (uploads: batch inputs and images; batches' outputs), at most
    # this many bytes on disk (0: no Files or Batch API).
    files_store_bytes: int = 1024 * 1024 * 1024
    # LoRA adapters requests may name as their model: (name, the adapter's folder), vLLM's
    # --lora-modules (the engine runs them: enable_lora).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # vLLM's runtime LoRA updating: /v1/load_lora_adapter and /v1/unload_lora_adapter.
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_name or not all(self.model_aliases):
            raise ValueError("served model names must not be empty.")
        names = [name for name, _ in self.lora_modules]
        for name in names:
            if not name or name in (self.served_model_name, *self.model_aliases):
                raise ValueError(f"--lora-modules names an adapter {name!r}: give each a "
                                 "name of its own, not empty and not the model's.")
            if names.count(name) > 1:
                raise ValueError(f"--lora-modules names {name!r} twice.")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}.")
        if self.responses_store_bytes < 0:
            raise ValueError(f"--responses-store-mib must be >= 0, got "
                             f"{self.responses_store_bytes / 2**20:g}.")
        if self.files_store_bytes < 0:
            raise ValueError(f"--files-store-mib must be >= 0, got "
                             f"{self.files_store_bytes / 2**20:g}.")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}.")
        if self.api_key == "":
            raise ValueError("the API key must not be empty; leave it out to disable auth.")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}): the format the model writes "
                             "its calls in.")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not known; use "
                             f"one of {', '.join(TOOL_CALL_PARSERS)}.")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials with --allowed-origins '*' would let every "
                             "web site call the API with its visitors' cookies; list the "
                             "origins that may.")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile.")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')} {path}: no such file.")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 "
                             f"(required), got {self.ssl_cert_reqs}.")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("--ssl-cert-reqs asks for client certificates: give the CA that "
                             "signs them with --ssl-ca-certs.")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs needs HTTPS: give --ssl-keyfile and "
                             "--ssl-certfile too.")
        if self.ssl_certfile is not None:
            _check_tls_files(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)
        for name in ("header_timeout_s", "body_timeout_s", "shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{flag} must be positive, got {getattr(self, name)}.")


def _check_tls_files(certfile: str, keyfile: str | None, ca_certs: str | None) -> None:
    """Load the certificate, its key and the CA file as the server will, so that a bad one
    stops ``serve`` before the model loads (a ``ValueError`` that names it)."""
    def no_passphrase() -> bytes:
        raise ValueError(f"--ssl-keyfile {keyfile} is encrypted; give a key without a "
                         "passphrase.")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=no_passphrase)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile}: {e}; give "
                         "a PEM certificate and its own key.") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-ca-certs {ca_certs}: {e}.") from None


def lora_modules_flag(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """``--lora-modules``' adapters as (name, folder), from vLLM's forms: ``name=path`` or
    a JSON object of ``name`` and ``path`` (and ``base_model_name``, which is not read: the
    adapters adapt the one model served). ``ValueError`` for a malformed one or a folder that
    is not there."""
    modules = []
    for value in values or ():
        if value.startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {value!r} is not JSON: {e}") from None
            if (not isinstance(spec, dict) or not isinstance(spec.get("name"), str)
                    or not isinstance(spec.get("path"), str)
                    or not set(spec) <= {"name", "path", "base_model_name"}):
                raise ValueError(f"--lora-modules {value!r}: a JSON adapter is an object of "
                                 'a "name" and a "path" (and vLLM\'s "base_model_name").')
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: write each adapter as name=path.")
        if not os.path.isdir(path):
            raise ValueError(f"--lora-modules {name}={path}: no such folder (a PEFT "
                             "adapter's, holding adapter_config.json).")
        modules.append((name, path))
    return tuple(modules)


def list_flag(values: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """A list flag's values (``default`` where it was not given), from each time it was
    given: vLLM's JSON list (``'["*"]'``), or values separated by commas. ``ValueError``
    for a malformed list."""
    if values is None:
        return default
    items: list[str] = []
    for value in values:
        if not value.startswith("["):
            items += [v.strip() for v in value.split(",") if v.strip()]
            continue
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{value!r} is not a JSON list: {e}") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"{value!r} must be a JSON list of strings.")
        items += parsed
    return tuple(items)


def _add_front_door_args(p: argparse.ArgumentParser) -> None:
    """The flags ``serve`` and ``run-batch`` share: the model, what requests may name and
    fetch, where the engine runs, tool calls, log-probabilities' form, and the engine's."""
    p.add_argument("model_path", nargs="?", metavar="MODEL",
                   help="local checkpoint directory (default: the bundled demo model)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model ids requests may name, as vLLM takes them: answers report the "
                   "first (default: MODEL; put MODEL before this flag)")
    p.add_argument("--max-request-body-bytes", type=int,
                   default=ServerConfig.max_request_body_bytes,
                   help="larger requests are refused")
    # One value each time, as the CORS flags take theirs: a model path after the flag stays
    # the model, never a host.
    p.add_argument("--allowed-media-domains", action="append", metavar="HOSTS",
                   help="hosts whose http(s) image URLs may be fetched: 'a.example,b.example' "
                   "or a JSON list; may be repeated")
    p.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="serve file:// image URLs under DIR")
    p.add_argument("--max-image-bytes", type=int, default=MediaPolicy.max_bytes)
    p.add_argument("--media-fetch-timeout", type=float, default=MediaPolicy.fetch_timeout_s,
                   help="seconds to fetch one image URL, from connecting to the last byte")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                   default=ServerConfig.engine_process,
                   help="run the engine in a process of its own, apart from HTTP, JSON, image "
                   "decoding and the processor (--no-engine-process: on a thread of the "
                   "server's process; default: its own process on a GPU, a thread on the CPU)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the model decides whether to call a tool, and '
                   "--tool-call-parser reads its calls (the default choice of requests with "
                   "tools)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   help="the format the model writes tool calls in (hermes: <tool_call> "
                   "blocks of JSON, as Qwen2.5 and Hermes write them)")
    p.add_argument("--enable-mm-embeds", action="store_true",
                   help="take images sent as their embeddings (image_embeds chat parts, "
                   "tensors saved with torch.save): for trusted clients only")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='name tokens "token_id:N" in log-probabilities, for clients that '
                   "want the ids the model picked (a request's return_tokens_as_token_ids "
                   "overrides it)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters (PEFT's folders) requests name as their model, as "
                   'vLLM takes them: name=path, or JSON \'{"name": ..., "path": ...}\'; '
                   "needs --enable-lora")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
                   in ("1", "true"),
                   help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, "
                   "which load and drop adapters by name at run time (any folder the server "
                   "can read: for trusted clients only; default: on where vLLM's "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING is true); needs --enable-lora")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's arguments; the caller sets what runs it."""
    p = sub.add_parser("serve", help="OpenAI-compatible image+text chat server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MMSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $MMSERVE_API_KEY)")
    p.add_argument("--max-queue", type=int, default=ServerConfig.max_queue,
                   help="requests waiting beyond max-num-seqs; past it, 503 with Retry-After")
    p.add_argument("--header-timeout", type=float, default=ServerConfig.header_timeout_s,
                   help="seconds a client has to send a request's headers")
    p.add_argument("--body-timeout", type=float, default=ServerConfig.body_timeout_s,
                   help="seconds a client has to send a request's body")
    p.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout_s,
                   help="on SIGTERM, seconds to let requests in flight finish before "
                   "aborting them")
    # One value each time (a JSON list, as vLLM's, or values separated by commas), so that
    # the model path after them is not read as one.
    p.add_argument("--allowed-origins", action="append", metavar="ORIGINS",
                   help="origins whose web pages may call the API (CORS): "
                   "'https://app.example.com,http://localhost:3000', '[\"*\"]' or '*' for "
                   "any (default: none)")
    p.add_argument("--allowed-methods", action="append", metavar="METHODS",
                   help='methods such pages may use (default: "*")')
    p.add_argument("--allowed-headers", action="append", metavar="HEADERS",
                   help='headers such pages may send (default: "*")')
    p.add_argument("--allow-credentials", action="store_true",
                   help="let such pages send cookies and HTTP authentication")
    p.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this key (PEM)")
    p.add_argument("--ssl-certfile", metavar="FILE",
                   help="and this certificate (PEM, the chain after it)")
    p.add_argument("--ssl-ca-certs", metavar="FILE",
                   help="CA certificates that client certificates are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 not asked for, 1 optional, 2 required")
    p.add_argument("--responses-store-mib", type=float,
                   default=ServerConfig.responses_store_bytes / 2**20,
                   help="memory for the Responses API's stored responses (store, "
                   "previous_response_id, background, GET /v1/responses/{id}), MiB of JSON, "
                   "and as much again for conversations (/v1/conversations); the least "
                   "recently used are forgotten past it; 0 stores none")
    p.add_argument("--files-store-mib", type=float,
                   default=ServerConfig.files_store_bytes / 2**20,
                   help="disk for the Files API's files (uploaded batch inputs and images, "
                   "batches' outputs: /v1/files and /v1/batches), MiB, in a temporary folder "
                   "removed at exit; 0 turns the Files and Batch APIs off")
    _add_front_door_args(p)
    return p


def add_run_batch_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``run-batch`` subcommand's arguments; the caller sets what runs it."""
    p = sub.add_parser(
        "run-batch", help="answer a file of OpenAI batch requests (JSON lines), offline",
        description="Answer each line of an OpenAI batch input file (custom_id, method, url, "
        "body; /v1/chat/completions, /v1/completions or /v1/responses) as the server would, "
        "writing one output line per input line, in the input's order.")
    p.add_argument("-i", "--input-file", required=True, metavar="PATH",
                   help="the requests, one JSON object a line ('-': standard input)")
    p.add_argument("-o", "--output-file", required=True, metavar="PATH",
                   help="where the answers go ('-': standard output)")
    _add_front_door_args(p)
    return p
