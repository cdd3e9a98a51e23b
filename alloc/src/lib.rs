//! The allocator the `kv-relay` daemon runs on: mimalloc, set so that freed memory goes back to
//! the system at once and arenas are committed as they are used.
//!
//! ```text
//! #[global_allocator]
//! static ALLOC: kv_relay_alloc::Allocator = kv_relay_alloc::Allocator;
//!
//! fn main() {
//!     kv_relay_alloc::tune();
//!     // ...
//! }
//! ```
//!
//! Why (docs/benchmarks.md): glibc's malloc and free were a third of the relay's CPU at
//! 1,000-2,000 batches a second. With mimalloc's defaults (freed memory purged after 1 s, arenas
//! committed whole) the relay held 344 MiB at a million live blocks and 58 MiB idle; set so, 210
//! and 14 MiB (glibc with its tuned settings: 228 and 12). `kv-router` keeps glibc's malloc: with
//! this allocator it held 808 MiB following 1,000 relays of 10,000 blocks, against 709.

pub use mimalloc::MiMalloc as Allocator;

/// mimalloc's options, as `mi_option_e` numbers them in the version Cargo.lock pins
/// (libmimalloc-sys 0.1.49, mimalloc v3); a test checks their defaults.
#[allow(unsafe_code)]
mod mi {
    use std::os::raw::{c_int, c_long};
    pub const ARENA_EAGER_COMMIT: c_int = 4;
    pub const PURGE_DELAY: c_int = 15;
    extern "C" {
        pub fn mi_option_set(option: c_int, value: c_long);
        #[cfg(test)]
        pub fn mi_option_get(option: c_int) -> c_long;
    }
}

/// Sets mimalloc's options: freed memory purged at once, arenas committed as used. Call it
/// first thing in `main`.
#[allow(unsafe_code)]
pub fn tune() {
    // SAFETY: plain setters of mimalloc's global options; any value is valid for both.
    unsafe {
        mi::mi_option_set(mi::PURGE_DELAY, 0);
        mi::mi_option_set(mi::ARENA_EAGER_COMMIT, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::mi;

    #[allow(unsafe_code)]
    fn options() -> (i64, i64) {
        // SAFETY: plain getters of mimalloc's global options.
        unsafe { (mi::mi_option_get(mi::ARENA_EAGER_COMMIT) as i64, mi::mi_option_get(mi::PURGE_DELAY) as i64) }
    }

    #[test]
    fn the_options_set_are_the_ones_meant() {
        // mimalloc v3's defaults (its options.c): a renumbered enum would read other options.
        assert_eq!(options(), (2, 1000));
        super::tune();
        assert_eq!(options(), (0, 0));
    }
}
