"""Follow kv-relays and route LLM requests to the worker that holds their prefix.

The Rust library kv-router-client (and kv-router's routing), from Python::

    from kv_router_client import Follower, Engine

    engine = Engine.vllm("0.32", block_size=16, algo="sha256_cbor")
    with Follower(["http://10.0.0.5:50051", "http://10.0.0.6:50051"]) as f:
        f.wait_ready()
        best = f.match_tokens(token_ids, engine=engine, limit=1)
        routed = f.route(token_ids=token_ids, engine=engine)
        ...  # send the request to routed["engine_url"], rank routed["dp_rank"]
        f.report(routed["request_id"], "done", prompt_tokens=..., cached_tokens=...)

See docs/router-client.md in the repository for the whole API.
"""

from ._native import (
    Closed,
    Engine,
    Error,
    Follower,
    Load,
    Match,
    Matches,
    NoWorker,
    ReportRejected,
    RouteFailed,
    Shed,
    __version__,
)

__all__ = [
    "Closed",
    "Engine",
    "Error",
    "Follower",
    "Load",
    "Match",
    "Matches",
    "NoWorker",
    "ReportRejected",
    "RouteFailed",
    "Shed",
    "__version__",
]
