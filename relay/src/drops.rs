//! Why an event or a message was not taken as sent: drop reasons and rewrites, with stable names
//! (they are metric labels and appear in `relayctl decode --json`).

use std::collections::BTreeMap;
use std::fmt;

macro_rules! fields {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// An event field the decoder reads.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Field { $($variant),* }

        impl Field {
            /// The field's wire name.
            pub fn as_str(self) -> &'static str {
                match self { $(Field::$variant => $name),* }
            }
            fn missing_label(self) -> &'static str {
                match self { $(Field::$variant => concat!("missing_", $name)),* }
            }
            fn invalid_label(self) -> &'static str {
                match self { $(Field::$variant => concat!("invalid_", $name)),* }
            }
        }
    };
}

fields! {
    BlockHashes => "block_hashes",
    ParentBlockHash => "parent_block_hash",
    TokenIds => "token_ids",
    BlockSize => "block_size",
    LoraId => "lora_id",
    Medium => "medium",
    LoraName => "lora_name",
    ExtraKeys => "extra_keys",
    GroupIdx => "group_idx",
    KvCacheSpecKind => "kv_cache_spec_kind",
    KvCacheSpecSlidingWindow => "kv_cache_spec_sliding_window",
    Locality => "locality",
    Ownership => "ownership",
    SessionId => "session_id",
    LookaheadTokenIds => "lookahead_token_ids",
    BlockMmInfos => "block_mm_infos",
    CacheSalt => "cache_salt",
    Metadata => "metadata",
}

/// Why one event was dropped. The rest of its batch is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// The event is neither a msgpack array nor a map.
    NotAnEvent,
    /// No `type` tag, or a tag that is not a string.
    MissingType,
    /// A tag other than `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.
    UnknownType,
    /// A required field is absent.
    Missing(Field),
    /// A field is present but cannot be read as its type.
    Invalid(Field),
    /// The batch ended inside this event (truncated payload).
    Truncated,
    /// `locality: REMOTE`: a copy held by another worker, not this one.
    RemoteLocality,
    /// A sliding-window (or chunked-local) group's event on a rank that also has a main-attention
    /// group: the main group alone decides prefix reuse.
    WindowGroupBesideMain,
    /// A store or removal with no block hashes (vLLM sends these for window groups).
    NoBlockHashes,
}

impl DropReason {
    /// The stable label.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::NotAnEvent => "not_an_event",
            DropReason::MissingType => "missing_type",
            DropReason::UnknownType => "unknown_type",
            DropReason::Missing(f) => f.missing_label(),
            DropReason::Invalid(f) => f.invalid_label(),
            DropReason::Truncated => "truncated_event",
            DropReason::RemoteLocality => "remote_locality",
            DropReason::WindowGroupBesideMain => "window_group_beside_main",
            DropReason::NoBlockHashes => "no_block_hashes",
        }
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event kept, but not exactly as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rewrite {
    /// A window-only group's store: hashes matched to the last blocks of `token_ids`.
    TailAligned,
    /// A store with no `token_ids` (offload placeholders): blocks carry no tokens.
    TokenIdsAbsent,
    /// `token_ids` does not fit `len(block_hashes) * block_size`: split from the head, blocks
    /// past the end carry no tokens.
    TokenIdsMismatch,
    /// Token ids beyond `u32` (SGLang's wide form): the store is kept without its tokens.
    TokenIdsWide,
}

impl Rewrite {
    pub fn as_str(self) -> &'static str {
        match self {
            Rewrite::TailAligned => "tail_aligned",
            Rewrite::TokenIdsAbsent => "token_ids_absent",
            Rewrite::TokenIdsMismatch => "token_ids_mismatch",
            Rewrite::TokenIdsWide => "token_ids_wide",
        }
    }
}

impl fmt::Display for Rewrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counts by label, for reports and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally(pub BTreeMap<&'static str, u64>);

impl Tally {
    pub fn add(&mut self, label: &'static str, n: u64) {
        *self.0.entry(label).or_default() += n;
    }

    pub fn get(&self, label: &str) -> u64 {
        self.0.get(label).copied().unwrap_or(0)
    }

    pub fn merge(&mut self, other: &Tally) {
        for (k, v) in &other.0 {
            self.add(k, *v);
        }
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_stable_snake_case() {
        assert_eq!(DropReason::Missing(Field::BlockHashes).as_str(), "missing_block_hashes");
        assert_eq!(
            DropReason::Invalid(Field::KvCacheSpecSlidingWindow).as_str(),
            "invalid_kv_cache_spec_sliding_window"
        );
        assert_eq!(DropReason::WindowGroupBesideMain.to_string(), "window_group_beside_main");
        assert_eq!(Rewrite::TailAligned.as_str(), "tail_aligned");
    }
}
