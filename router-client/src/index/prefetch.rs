//! Prefetch hints: ask the CPU for a cache line before it is used, so that the misses of the
//! next probes overlap the work on this one.
//!
//! A hint is not a load. Until this module, the index "touched" a probe's lines with plain
//! loads, which has two costs a hint does not: a load that misses holds up retirement until
//! its line arrives, and every locked instruction after it waits for it to complete (x86
//! orders loads before locked instructions; `PREFETCHT0` is ordered with neither). A writer
//! takes a shard's lock per block, so a block's loads could not overlap the previous block's
//! work: each window of touched probes paid a whole miss. Hints issued eight blocks ahead let
//! those misses overlap the work on the blocks before them.
//!
//! A writer asks for the lines it will write with a *write* hint (`PREFETCHW`), which fetches
//! them owned: a line a lookup thread on another core has read is shared, and a store to it
//! first has to take it from that core. With a read hint the writer held its line shared, and
//! that upgrade was paid at the shard lock's locked instructions, which wait for every store
//! before them; owned, the line is the writer's when the lock is taken. This matters most when
//! the whole index is in cache and a lookup thread reads the same lines.
//!
//! These are two of the crate's three `unsafe` blocks (the third is the lookups' read of the
//! table set, `PrefixIndex::section_tables`). `_mm_prefetch` reads nothing the program can see
//! and never faults, whatever the address; it is `unsafe` only because it is declared with
//! `#[target_feature(enable = "sse")]`, which every x86_64 CPU has (it is in the x86_64
//! baseline that std is built for). Rust has no stable write hint (`_MM_HINT_ET0` compiles to a
//! read hint unless the unstable `prfchw` feature is enabled), so the write hint is one
//! `PREFETCHW` instruction in `asm!`, used only where CPUID says the CPU has it (else the read
//! hint): like `PREFETCHT0`, it changes no register, flag or memory and never faults. On other
//! targets both hints are the plain load that the read hint replaced.

use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

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

/// Asks for the cache line holding `word`, owned, to be written soon (module docs). Changes
/// nothing the program can observe but timing.
#[inline(always)]
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(super) fn prefetch_write(word: &impl Line) {
    if !has_write_hint() {
        return prefetch(word);
    }
    // SAFETY: `PREFETCHW` accesses no memory the program can observe, never faults for any
    // address, and changes no register or flag; the CPU has it (checked above).
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) std::ptr::from_ref(word), options(nostack, preserves_flags, readonly))
    }
}

/// Asks for the cache line holding `word` to be written soon: without a hint on this target,
/// a load whose value is discarded.
#[inline(always)]
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn prefetch_write(word: &impl Line) {
    prefetch(word);
}

/// Whether the CPU has `PREFETCHW`: CPUID leaf `0x8000_0001`, ECX bit 8 (`PRFCHW`, named
/// `3DNowPrefetch` by AMD). Asked once per process; a load after that.
#[cfg(target_arch = "x86_64")]
fn has_write_hint() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(cpu_has_prefetchw)
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_prefetchw() -> bool {
    use std::arch::x86_64::__cpuid;
    const EXTENDED: u32 = 0x8000_0001;
    __cpuid(0x8000_0000).eax >= EXTENDED && __cpuid(EXTENDED).ecx & (1 << 8) != 0
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn the_write_hint_is_used_exactly_where_cpuid_reports_it() {
        let reported = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| info.lines().find(|l| l.starts_with("flags")).map(str::to_owned))
            .map(|flags| flags.split_whitespace().any(|f| f == "3dnowprefetch"));
        // Where the kernel lists the CPU's flags, it agrees with our CPUID reading.
        if let Some(reported) = reported {
            assert_eq!(cpu_has_prefetchw(), reported);
        }
        assert_eq!(has_write_hint(), cpu_has_prefetchw());
        // Asked again: the cached answer.
        assert_eq!(has_write_hint(), cpu_has_prefetchw());
        let word = AtomicU64::new(7);
        prefetch_write(&word);
        assert_eq!(word.load(Ordering::Relaxed), 7);
    }
}
