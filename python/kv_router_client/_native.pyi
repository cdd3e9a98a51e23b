"""Type stubs of the extension module (the package's API)."""

from types import TracebackType
from typing import Any, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Type, Union, overload

__version__: str

EngineSettings = Union["Engine", Mapping[str, Any], str]
Outcome = Literal["done", "failed", "connect_failed"]

class Error(Exception):
    """The base of the package's own errors."""

class RouteFailed(Error):
    """A request could not be routed (NoWorker or Shed)."""

class NoWorker(RouteFailed):
    """No worker is routable."""

class Shed(RouteFailed):
    """Every routable worker is overloaded, and shedding is on."""

class ReportRejected(Error):
    """A report named no routed request in flight (unknown, already reported, or forgotten)."""

class Closed(Error):
    """The follower was closed."""

class Engine:
    """An engine's block-hash settings: how it turns token ids into the block hashes it publishes."""

    @staticmethod
    def vllm(
        version: str, block_size: int, algo: str = "sha256", python_hash_seed: Optional[str] = None
    ) -> "Engine":
        """vLLM: its release (e.g. "0.32"), block size, --prefix-caching-hash-algo
        ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor") and PYTHONHASHSEED when set."""
    @staticmethod
    def sglang(version: str, page_size: int, eagle: bool = False) -> "Engine":
        """SGLang: its release (e.g. "0.5.23"), page size and EAGLE bigram keys."""
    @staticmethod
    def from_json(settings: Union[Mapping[str, Any], str]) -> "Engine":
        """The settings as kv-router's --engine-hash takes them, as a dict or a JSON string."""
    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: Optional[str] = None,
        lora_name: Optional[str] = None,
        lora_path: Optional[str] = None,
    ) -> List[int]:
        """The block hashes the engine publishes for these token ids (full blocks only)."""

class Load:
    """An engine's load as its relay last reported it."""

    @property
    def running(self) -> float: ...
    @property
    def waiting(self) -> float: ...
    @property
    def kv_usage(self) -> float:
        """KV-cache usage, 0..1."""
    @property
    def scraped_at_ms(self) -> int:
        """Unix milliseconds of the relay's scrape of the engine."""

class Match:
    """One worker's answer to a lookup."""

    @property
    def relay(self) -> str:
        """The relay's URL."""
    @property
    def dp_rank(self) -> int: ...
    @property
    def matched_blocks(self) -> int:
        """Leading blocks of the request held in any tier."""
    @property
    def by_tier(self) -> Dict[str, int]:
        """Leading blocks held within each tier alone (tiers with 0 left out)."""
    @property
    def state(self) -> str:
        """"ready", "stale", "degraded", "incomplete", "stopped" ..."""
    @property
    def load(self) -> Optional[Load]: ...
    def to_dict(self) -> Dict[str, Any]:
        """The match as kv-router's POST /match lists it."""

class Matches(Sequence[Match]):
    """A lookup's answer, in order: a read-only sequence of Match (len, indexes, slices,
    iteration; list(answer) makes a list). Each Match is made when it is read, so an answer
    over many workers costs one object until its items are used."""

    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int) -> Match: ...
    @overload
    def __getitem__(self, index: slice) -> List[Match]: ...
    def __iter__(self) -> Iterator[Match]: ...
    def __eq__(self, other: object) -> bool:
        """Equal to another answer, or to a list or tuple of the same Matches in order."""
    def to_dicts(self) -> List[Dict[str, Any]]:
        """Every match as kv-router's POST /match lists it."""

class Follower:
    """Follows kv-relays and holds the prefix index of every worker behind them."""

    def __init__(
        self,
        relays: Optional[Sequence[str]] = None,
        *,
        dns: Optional[Sequence[str]] = None,
        stale_after_ms: float = 2000.0,
        receive_timeout_ms: float = 5000.0,
        connect_timeout_ms: float = 5000.0,
        status_interval_ms: float = 5000.0,
        allow_snapshot: bool = True,
        bearer_token: Optional[str] = None,
        tls_ca_pem: Optional[bytes] = None,
        max_message_bytes: int = 64 << 20,
        max_concurrent_resyncs: int = 16,
        start_jitter_ms: float = 500.0,
        dns_interval_ms: float = 5000.0,
        dns_grace_ms: float = 30000.0,
        policy: str = "cache_aware",
        overload_kv_usage: float = 0.8,
        overload_waiting: float = 8.0,
        overload_protection: bool = True,
        shed: bool = False,
        seed: Optional[int] = None,
    ) -> None: ...
    def add_relay(self, url: str) -> None: ...
    def remove_relay(self, url: str) -> None: ...
    def match(
        self, block_hashes: Sequence[int], *, matched_only: bool = False, limit: Optional[int] = None
    ) -> Matches:
        """Every ready worker (by relay then rank), with the request's leading blocks it holds."""
    def match_tokens(
        self,
        token_ids: Sequence[int],
        *,
        engine: EngineSettings,
        cache_salt: Optional[str] = None,
        lora_name: Optional[str] = None,
        lora_path: Optional[str] = None,
        matched_only: bool = False,
        limit: Optional[int] = None,
    ) -> Matches: ...
    def route(
        self,
        block_hashes: Optional[Sequence[int]] = None,
        *,
        token_ids: Optional[Sequence[int]] = None,
        engine: Optional[EngineSettings] = None,
        cache_salt: Optional[str] = None,
        lora_name: Optional[str] = None,
        lora_path: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Where the request goes: request_id, relay, dp_rank, engine_url, blocks,
        matched_blocks, device_blocks, reason, policy, expected_wait_us."""
    def report(
        self,
        request_id: int,
        outcome: Outcome = "done",
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: Optional[int] = None,
    ) -> Dict[str, Any]: ...
    def workers(self) -> List[Dict[str, Any]]: ...
    def relays(self) -> List[Dict[str, Any]]: ...
    def counters(self) -> Dict[str, Any]: ...
    def wait_ready(self, timeout: float = 10.0) -> bool: ...
    @property
    def policy(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Follower": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
