//! Prefetch hints: ask the CPU for a cache line before it is used, so that the misses of the
//! next probes overlap the work on this one.
//!
//! A hint is not a load. Until this module, the index "touched" a probe's lines with plain
//! loads, which has two costs a hint does not: a load that misses holds up retirement until
//! its line arrives, and every locked instruction after it waits for it to complete (x86
//! orders loads before locked instructions; `PREFETCHT0` is ordered with neither). A writer
//! takes a shard's mutex per block, so a block's loads could not overlap the previous block's
//! work: each window of touched probes paid a whole miss. With hints issued eight blocks
//! ahead, the 128-worker Mooncake bench's writer applied 16-23% more block operations per
//! second in the same process (`docs/benchmarks.md`, Eighth measurement).
//!
//! This is the crate's one `unsafe` block. `_mm_prefetch` reads nothing the program can see
//! and never faults, whatever the address; it is `unsafe` only because it is declared with
//! `#[target_feature(enable = "sse")]`, which every x86_64 CPU has (it is in the x86_64
//! baseline that std is built for). On other targets the hint is the plain load it replaced.

use std::sync::atomic::{AtomicU64, Ordering};

/// A word whose cache line can be asked for.
pub(super) trait Line {
    /// Reads the word (the fallback where no hint is available).
    #[cfg_attr(target_arch = "x86_64", allow(dead_code))]
    fn read(&self) -> u64;
}

impl Line for AtomicU64 {
    #[inline]
    fn read(&self) -> u64 {
        self.load(Ordering::Relaxed)
    }
}

impl Line for u64 {
    #[inline]
    fn read(&self) -> u64 {
        *self
    }
}

/// Asks for the cache line holding `word`, to be used soon. Changes nothing the program can
/// observe but timing.
#[inline(always)]
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) fn prefetch(word: &impl Line) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    // SAFETY: a prefetch hint accesses no memory the program can observe and never faults,
    // for any address; the intrinsic's only requirement is its `sse` target feature, which is
    // part of the x86_64 baseline (see the module docs).
    unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(word).cast::<i8>()) }
}

/// Asks for the cache line holding `word`: without a stable hint on this target, a load
/// whose value is discarded.
#[inline(always)]
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn prefetch(word: &impl Line) {
    std::hint::black_box(word.read());
}
