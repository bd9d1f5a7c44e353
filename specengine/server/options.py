"""``ServerOptions``: how ``specengine serve`` limits, authenticates and exposes itself (every
field a flag of ``specengine serve`` and a keyword of ``build_app``), and ``is_loopback``."""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass, field

MiB, GiB = 1 << 20, 1 << 30

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this
    machine."""
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


@dataclass
class ServerOptions:
    """How ``specengine serve`` limits, authenticates and exposes itself; every field is a
    flag of ``specengine serve`` (``--api-key``, ``--max-queued-requests``, ...) and a keyword
    of ``build_app``. The defaults are the safe ones: loopback only, no control routes, no
    request-supplied chat templates, no weights from disk.

    Attributes:
        api_key: when set, every route but ``/health`` (and TRL's ``/health/``) needs
            ``Authorization: Bearer <api_key>`` (401 otherwise; compared in constant time).
            The CLI reads ``SPECENGINE_API_KEY`` when ``--api-key`` is not given.
        enable_control_routes: serve the routes that change the server (sleep / wake-up,
            weight pushes and weights from disk, prefix-cache reset, TRL's
            ``/update_named_param/``, ``/init_communicator/``, ``/close_communicator/``,
            ``/reset_prefix_cache/``); off: they answer 404. On, they accept only
            ``application/json`` or ``application/octet-stream`` bodies (415), or none, and
            refuse requests a browser marks as cross-site (403).
        host: the address served; decides ``allowed_hosts``' default.
        allowed_hosts: the ``Host`` header values accepted (port ignored; ``"*"``: any), else
            a 400. None: ``localhost`` / ``127.0.0.1`` / ``[::1]`` when ``host`` is a
            loopback address (a web page that rebinds its own DNS name to 127.0.0.1 cannot
            reach the server), any host otherwise.
        trust_request_chat_template: accept a ``chat_template`` in the request (or in
            ``chat_template_kwargs``); off: a 400.
        chat_template_timeout: seconds a chat template may take to render (it runs on a
            worker thread, never on the event loop); longer: the render is stopped, a 400.
        allowed_weight_dirs: directories ``/update_weights_from_disk`` may load from (the
            path, symlinks resolved, must be below one; ``..`` is refused). Empty: the route
            refuses every path.
        max_request_body_bytes: largest request body, bytes (413), weight pushes excepted.
        max_weight_body_bytes: largest body of a weight push (``/update_named_param/``,
            ``/update_weights``), bytes (413).
        max_queued_requests: most engine requests (one per prompt) admitted and not finished,
            running or waiting, over all clients; a request that would pass it is a 429 with
            ``Retry-After`` (SGLang's ``--max-queued-requests``).
        max_n: most samples per prompt (``n``); the engine's ``max_num_seqs`` caps it too (the
            samples of a prompt are admitted together).
        max_prompts_per_request: most prompts in one request (batch completions, TRL's
            ``/generate/`` and ``/chat/``).
        max_stop_strings: most stop strings per request; max_stop_string_len: the longest, in
            characters; max_stop_token_ids: most stop token ids.
        request_timeout: seconds from admission until a request must have finished; then it is
            aborted (its KV freed) and answered 504 (a stream gets an error event); 0 or None:
            no limit.
        max_request_memory_bytes: most host memory the outputs of one request may take at
            their longest (token ids, and logprob entries: see ``request_memory_bytes``), bytes;
            more: a 400 naming ``n`` (or ``logprobs`` when logprobs make the difference).
    """

    api_key: str | None = None
    enable_control_routes: bool = False
    host: str = "127.0.0.1"
    allowed_hosts: list[str] | None = None
    trust_request_chat_template: bool = False
    chat_template_timeout: float = 10.0
    allowed_weight_dirs: list[str] = field(default_factory=list)
    max_request_body_bytes: int = 16 * MiB
    max_weight_body_bytes: int = 4 * GiB
    max_queued_requests: int = 4096
    max_n: int = 256
    max_prompts_per_request: int = 1024
    max_stop_strings: int = 16
    max_stop_string_len: int = 512
    max_stop_token_ids: int = 256
    request_timeout: float | None = 1800.0
    max_request_memory_bytes: int = 1 * GiB

    def __post_init__(self):
        for name in ("max_request_body_bytes", "max_weight_body_bytes", "max_queued_requests",
                     "max_n", "max_prompts_per_request", "max_stop_strings",
                     "max_stop_string_len", "max_stop_token_ids", "max_request_memory_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServerOptions.{name}={v!r}: must be an integer >= 1")
        for name in ("chat_template_timeout", "request_timeout"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0):
                raise ValueError(f"ServerOptions.{name}={v!r}: must be a number of seconds "
                                 ">= 0")
        if not self.chat_template_timeout:
            raise ValueError("ServerOptions.chat_template_timeout must be > 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerOptions.api_key must not be empty (None: no key)")
        if isinstance(self.allowed_weight_dirs, (str, os.PathLike)):
            self.allowed_weight_dirs = [self.allowed_weight_dirs]
        self.allowed_weight_dirs = [str(d) for d in self.allowed_weight_dirs]
        if isinstance(self.allowed_hosts, str):
            self.allowed_hosts = [self.allowed_hosts]

    def host_allow_list(self) -> set[str] | None:
        """The ``Host`` names accepted (lower case, no brackets, no port), or None for any."""
        hosts = self.allowed_hosts
        if hosts is None:
            if not is_loopback(self.host):
                return None
            hosts = list(LOOPBACK_HOSTS)
        names = {h.strip().strip("[]").lower() for h in hosts if h.strip()}
        return None if "*" in names else names
