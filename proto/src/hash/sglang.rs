//! SGLang block (page) hashes.
//!
//! * 0.4.8–0.5.5: `hash(tuple(page))`, CPython's builtin tuple hash of the page's token ids
//!   (deterministic for ints, not chained): [`page_tuple_hash`].
//! * 0.5.6+: chained SHA-256, `digest_i = SHA256(digest_{i-1} || tokens as u32 LE)` with no
//!   prior for the first page of a sequence, event value = first 8 digest bytes as a
//!   big-endian `i64`: [`page_digest`], [`digest_to_i64`]. The native hasher switches to a
//!   wide form, `SHA256(prior || 0xff || tokens as u64 LE)`, when a token exceeds `u32::MAX`.
//! * EAGLE (0.5.3+): the radix key is bigrams `(t0,t1),(t1,t2),…`; a page holds `page_size`
//!   bigrams and both elements of every pair are hashed.
//! * 0.5.18+: a salted request's chain starts from [`salt_prior`] instead of nothing. The
//!   prior is the 32 *raw* bytes of `SHA256(b"sglang-cache-salt-v1\0" + salt)`; seeding
//!   with the 64-byte hex digest instead reproduces 165 of the 200 hashes of the
//!   `sglang-basic` capture, raw bytes all 200.
//! * 0.5.22+: LoRA requests' event hashes are namespaced, [`namespaced_block_hash`] with
//!   [`namespace_seed`]`(Some(extra_key), None)` (the `"default"` event format). The chain
//!   itself is not namespaced: a salted LoRA request chains from the salt prior and
//!   namespaces each page's value (seed part for the salt `00`), as `sglang-basic` shows.
//!   The namespace key is the radix `extra_key` (the LoRA id), not the `lora_name` that
//!   events carry, so LoRA hashes cannot be re-derived from the wire alone.

use sha2::{Digest, Sha256};

use super::version::EngineVersion;
use super::HashError;

/// `hash(())` in CPython (64-bit): the parent SGLang 0.4.8–0.5.5 reports for root children.
pub const EMPTY_TUPLE_HASH: i64 = 5_740_354_900_026_072_187;

const XXPRIME_1: u64 = 11_400_714_785_074_694_791;
const XXPRIME_2: u64 = 14_029_467_366_897_019_727;
const XXPRIME_5: u64 = 2_870_177_450_012_600_261;
/// CPython's `_PyHASH_MODULUS` (2**61 - 1).
const HASH_MODULUS: u64 = (1 << 61) - 1;

const SALT_DOMAIN: &[u8] = b"sglang-cache-salt-v1\0";
const NAMESPACE_DOMAIN: &[u8] = b"sglang-kv-event-namespace-v1";

const TUPLE_HASH_SINCE: EngineVersion = EngineVersion::new(0, 4, 8);
const CHAINED_SINCE: EngineVersion = EngineVersion::new(0, 5, 6);
const EAGLE_SINCE: EngineVersion = EngineVersion::new(0, 5, 3);
const SALT_SINCE: EngineVersion = EngineVersion::new(0, 5, 18);
const NAMESPACE_SINCE: EngineVersion = EngineVersion::new(0, 5, 22);

/// CPython's `hash(int)` for a non-negative int: the value modulo 2**61 - 1.
pub fn cpython_int_hash(v: u64) -> i64 {
    (v % HASH_MODULUS) as i64
}

/// CPython's (3.8+, 64-bit) tuple hash over the hashes of the items.
pub fn cpython_tuple_hash(item_hashes: &[i64]) -> i64 {
    let mut acc = XXPRIME_5;
    for &h in item_hashes {
        acc = acc.wrapping_add((h as u64).wrapping_mul(XXPRIME_2));
        acc = acc.rotate_left(31);
        acc = acc.wrapping_mul(XXPRIME_1);
    }
    acc = acc.wrapping_add(item_hashes.len() as u64 ^ (XXPRIME_5 ^ 3_527_539));
    if acc == u64::MAX {
        return 1_546_275_796;
    }
    acc as i64
}

/// `hash(tuple(page))` of a page of token ids (SGLang 0.4.8–0.5.5).
pub fn page_tuple_hash(page: &[u64]) -> i64 {
    let items: Vec<i64> = page.iter().map(|&t| cpython_int_hash(t)).collect();
    cpython_tuple_hash(&items)
}

/// `hash(tuple(page))` of an EAGLE page of bigram tuples (SGLang 0.5.3–0.5.5).
pub fn bigram_page_tuple_hash(page: &[(u64, u64)]) -> i64 {
    let items: Vec<i64> =
        page.iter().map(|&(a, b)| cpython_tuple_hash(&[cpython_int_hash(a), cpython_int_hash(b)])).collect();
    cpython_tuple_hash(&items)
}

/// One page's SHA-256 digest over its flattened token ids, chained on `prior`.
pub fn page_digest(prior: Option<&[u8]>, tokens: &[u64]) -> [u8; 32] {
    let mut h = Sha256::new();
    if let Some(p) = prior {
        h.update(p);
    }
    if tokens.iter().any(|&t| t > u64::from(u32::MAX)) {
        h.update([0xff]);
        for &t in tokens {
            h.update(t.to_le_bytes());
        }
    } else {
        for &t in tokens {
            h.update((t as u32).to_le_bytes());
        }
    }
    h.finalize().into()
}

/// An EAGLE page's digest: both elements of every bigram, in order.
pub fn bigram_page_digest(prior: Option<&[u8]>, page: &[(u64, u64)]) -> [u8; 32] {
    let flat: Vec<u64> = page.iter().flat_map(|&(a, b)| [a, b]).collect();
    page_digest(prior, &flat)
}

/// The event value of a digest: its first 8 bytes, big-endian, as `i64`
/// (SGLang's `hash_str_to_int64`).
pub fn digest_to_i64(digest: &[u8; 32]) -> i64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(b)
}

/// The chain prior of a salted request: `SHA256(b"sglang-cache-salt-v1\0" + salt)`, raw bytes.
pub fn salt_prior(salt: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(SALT_DOMAIN);
    h.update(salt.as_bytes());
    h.finalize().into()
}

fn namespace_part(h: &mut Sha256, part: Option<&str>) {
    match part {
        None => h.update([0u8]),
        Some(s) => {
            h.update([1u8]);
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
    }
}

/// `SHA256(b"sglang-kv-event-namespace-v1" || part(extra_key) || part(cache_salt))` with
/// `part(None) = 00` and `part(s) = 01 || u64 LE len || utf8`.
pub fn namespace_seed(extra_key: Option<&str>, cache_salt: Option<&str>) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(NAMESPACE_DOMAIN);
    namespace_part(&mut h, extra_key);
    namespace_part(&mut h, cache_salt);
    h.finalize().into()
}

/// `i64_be(SHA256(seed || h.to_bytes(8, "big", signed=True))[:8])`.
pub fn namespaced_block_hash(hash: i64, seed: &[u8; 32]) -> i64 {
    let mut h = Sha256::new();
    h.update(seed);
    h.update(hash.to_be_bytes());
    digest_to_i64(&h.finalize().into())
}

/// Which page hash a release computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SglangHashScheme {
    /// 0.4.8–0.5.5: CPython `hash(tuple(page))`, not chained.
    PageTupleHash,
    /// 0.5.6+: chained SHA-256.
    ChainedSha256,
}

/// What an SGLang request contributes to its page hashes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SglangRequest<'a> {
    /// All token ids (prompt then output); only full pages are hashed.
    pub token_ids: &'a [u64],
    /// The request's cache salt (0.5.18+; ignored when empty).
    pub cache_salt: Option<&'a str>,
    /// The radix-tree `extra_key` of a LoRA request (the LoRA id, not its display name).
    pub lora_extra_key: Option<&'a str>,
}

/// An SGLang engine's page hash function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SglangHasher {
    scheme: SglangHashScheme,
    page_size: usize,
    eagle: bool,
    salt_seeding: bool,
    lora_namespacing: bool,
}

impl SglangHasher {
    /// The hasher of a release. Releases before 0.4.8 hashed whole radix nodes (their
    /// hashes depend on the tree's shape) and are rejected.
    pub fn for_release(version: EngineVersion, page_size: usize, eagle: bool) -> Result<Self, HashError> {
        if version < TUPLE_HASH_SINCE {
            return Err(HashError::UnsupportedVersion { engine: "sglang", version });
        }
        if eagle && version < EAGLE_SINCE {
            return Err(HashError::Unsupported("eagle bigram keys before sglang 0.5.3"));
        }
        let scheme =
            if version >= CHAINED_SINCE { SglangHashScheme::ChainedSha256 } else { SglangHashScheme::PageTupleHash };
        let mut hasher = Self::new(scheme, page_size, eagle)?;
        hasher.salt_seeding = version >= SALT_SINCE;
        hasher.lora_namespacing = version >= NAMESPACE_SINCE;
        Ok(hasher)
    }

    /// A hasher from its parts; the chained scheme gets salt seeding and LoRA namespacing
    /// (the current behaviour).
    pub fn new(scheme: SglangHashScheme, page_size: usize, eagle: bool) -> Result<Self, HashError> {
        if page_size == 0 {
            return Err(HashError::ZeroBlockSize);
        }
        let chained = scheme == SglangHashScheme::ChainedSha256;
        Ok(Self { scheme, page_size, eagle, salt_seeding: chained, lora_namespacing: chained })
    }

    /// The scheme.
    pub fn scheme(&self) -> SglangHashScheme {
        self.scheme
    }

    /// Tokens (or bigrams, with EAGLE) per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Whether pages are bigram pages.
    pub fn eagle(&self) -> bool {
        self.eagle
    }

    /// The signed event hash of every full page of the request, in order.
    pub fn page_hashes(&self, request: &SglangRequest<'_>) -> Result<Vec<i64>, HashError> {
        let salt = request.cache_salt.filter(|s| !s.is_empty());
        if salt.is_some() && !self.salt_seeding {
            return Err(HashError::Unsupported("cache salts before sglang 0.5.18 (not modelled)"));
        }
        if request.lora_extra_key.is_some() && !self.lora_namespacing {
            return Err(HashError::Unsupported("lora namespacing before sglang 0.5.22 (not modelled)"));
        }
        let tokens = request.token_ids;
        let bigrams: Vec<(u64, u64)> =
            if self.eagle { tokens.windows(2).map(|w| (w[0], w[1])).collect() } else { Vec::new() };
        let units = if self.eagle { bigrams.len() } else { tokens.len() };
        let pages = units / self.page_size;
        let mut out = Vec::with_capacity(pages);
        match self.scheme {
            SglangHashScheme::PageTupleHash => {
                for i in 0..pages {
                    let r = i * self.page_size..(i + 1) * self.page_size;
                    out.push(if self.eagle {
                        bigram_page_tuple_hash(&bigrams[r])
                    } else {
                        page_tuple_hash(&tokens[r])
                    });
                }
            }
            SglangHashScheme::ChainedSha256 => {
                let mut prior: Option<[u8; 32]> = salt.map(salt_prior);
                let ns = request.lora_extra_key.map(|key| namespace_seed(Some(key), None));
                for i in 0..pages {
                    let r = i * self.page_size..(i + 1) * self.page_size;
                    let p = prior.as_ref().map(|p| p.as_slice());
                    let digest =
                        if self.eagle { bigram_page_digest(p, &bigrams[r]) } else { page_digest(p, &tokens[r]) };
                    let h = digest_to_i64(&digest);
                    out.push(match &ns {
                        Some(seed) => namespaced_block_hash(h, seed),
                        None => h,
                    });
                    prior = Some(digest);
                }
            }
        }
        Ok(out)
    }

    /// [`SglangHasher::page_hashes`] as unsigned 64-bit values (two's complement bits), the
    /// form the relay normalises event hashes to.
    pub fn block_event_hashes(&self, request: &SglangRequest<'_>) -> Result<Vec<u64>, HashError> {
        Ok(self.page_hashes(request)?.into_iter().map(|h| h as u64).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpython_tuple_hash_matches_known_values() {
        assert_eq!(cpython_tuple_hash(&[]), EMPTY_TUPLE_HASH);
        // hash((1, 2, 3, 4)) and hash((25, 26)) in CPython 3.11.
        assert_eq!(page_tuple_hash(&[1, 2, 3, 4]), 590_899_387_183_067_792);
        assert_eq!(page_tuple_hash(&[25, 26]), 6_878_325_583_076_041_982);
        assert_eq!(page_tuple_hash(&[21, 22, 23, 24]), -4_054_422_734_329_649_700);
        assert_eq!(cpython_int_hash(HASH_MODULUS), 0);
    }

    #[test]
    fn wide_tokens_switch_to_u64_encoding() {
        let mut h = Sha256::new();
        h.update([0xff]);
        h.update(1u64.to_le_bytes());
        h.update((1u64 << 32).to_le_bytes());
        let want: [u8; 32] = h.finalize().into();
        assert_eq!(page_digest(None, &[1, 1 << 32]), want);
        let narrow: [u8; 32] = Sha256::digest([1u8, 0, 0, 0]).into();
        assert_eq!(page_digest(None, &[1]), narrow);
    }
}
