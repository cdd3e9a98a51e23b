//! The allocator the `kv-relay` daemon runs on: mimalloc, set so that freed memory goes back to
//! the system at once and arenas are committed as they are used.
//!
//! ```text
//! #[global_allocator]
//! static ALLOC: kv_relay_alloc::Allocator = kv_relay_alloc::Allocator;
//!
//! fn main() {
//!     if !kv_relay_alloc::tuned() { /* warn: the options were set late */ }
//!     // ...
//! }
//! ```
//!
//! **When they are set.** mimalloc reserves its first arena with the first allocation, so an
//! option of arenas set in `main` comes too late for the memory the process lives in (an idle
//! relay then holds several times the memory; docs/benchmarks.md, the relay's defaults).
//! On Linux this crate sets them as defaults from a constructor that runs before mimalloc's own
//! (`.init_array` with priority 100; mimalloc's runs at 101 or later), so `MIMALLOC_PURGE_DELAY`
//! and `MIMALLOC_ARENA_EAGER_COMMIT` in the environment still override them. Elsewhere [`tuned`]
//! sets them, late.
//!
//! Why: the relay allocates and frees per event, and mimalloc costs it less CPU than glibc's
//! malloc at engine rates. mimalloc's own defaults (freed memory purged late, arenas committed
//! whole) hold memory the relay no longer uses, so the relay sets shorter ones. `kv-router`
//! keeps glibc's malloc, which holds less following a large fleet. The figures behind each
//! choice are in docs/benchmarks.md (the relay's defaults, a router following a fleet).

pub use mimalloc::MiMalloc as Allocator;

use std::os::raw::{c_char, c_int, c_long, c_void};

/// The options set: mimalloc's name, its number in `mi_option_e` (the version Cargo.lock pins,
/// libmimalloc-sys 0.1.49, mimalloc v3; a test reads them back by name), the value.
const OPTIONS: [(&str, c_int, c_long); 2] = [("arena_eager_commit", 4, 0), ("purge_delay", 15, 0)];

#[allow(unsafe_code)]
mod mi {
    use std::os::raw::{c_char, c_int, c_long, c_void};
    pub type Output = unsafe extern "C" fn(msg: *const c_char, arg: *mut c_void);
    extern "C" {
        pub fn mi_option_set_default(option: c_int, value: c_long);
        pub fn mi_option_set(option: c_int, value: c_long);
        pub fn mi_options_print_out(out: Output, arg: *mut c_void);
    }
}

/// Runs before mimalloc's constructor (and so before any allocation through it): lower
/// priorities of `.init_array` run first.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
#[used]
#[link_section = ".init_array.00100"]
static SET_BEFORE_INIT: extern "C" fn() = set_defaults;

#[allow(unsafe_code)]
extern "C" fn set_defaults() {
    for (_, option, value) in OPTIONS {
        // SAFETY: a plain setter of mimalloc's static option table, valid before its init.
        unsafe { mi::mi_option_set_default(option, value) };
    }
}

/// mimalloc's options as it reports them (`mi_options_print_out`): each option's name and value.
#[allow(unsafe_code)]
pub fn options() -> Vec<(String, c_long)> {
    unsafe extern "C" fn collect(msg: *const c_char, arg: *mut c_void) {
        // SAFETY: mimalloc passes a NUL-terminated line; `arg` is the `String` below.
        let (msg, out) = unsafe { (std::ffi::CStr::from_ptr(msg), &mut *(arg as *mut String)) };
        out.push_str(&msg.to_string_lossy());
    }
    let mut text = String::new();
    // SAFETY: `collect` only appends to `text`, which outlives the call.
    unsafe { mi::mi_options_print_out(collect, &mut text as *mut String as *mut c_void) };
    text.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("option '")?.split_once("': ")?;
            Some((name.to_string(), rest.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

/// Whether mimalloc runs with this crate's options (or the environment's for them), set before
/// its first arena. On Linux it only reads them back, so where in `main` it is called does not
/// matter. Where the constructor does not run (not Linux) it sets them now and says `false`:
/// too late for the first arena, so call it as early in `main` as possible there.
#[allow(unsafe_code)]
pub fn tuned() -> bool {
    if !cfg!(target_os = "linux") {
        for (_, option, value) in OPTIONS {
            // SAFETY: a plain setter of mimalloc's global options; any value is valid for both.
            unsafe { mi::mi_option_set(option, value) };
        }
        return false;
    }
    let all = options();
    OPTIONS.iter().all(|&(name, _, value)| {
        std::env::var_os(format!("MIMALLOC_{}", name.to_uppercase())).is_some()
            || all.iter().any(|(n, v)| n == name && *v == value)
    })
}

#[cfg(test)]
mod tests {
    use super::{options, OPTIONS};

    #[test]
    fn the_options_are_set_before_main_and_by_name() {
        // Read by name, so a renumbered `mi_option_e` fails here; the environment of the test
        // must not set them (it would override the values).
        let all = options();
        for (name, _, value) in OPTIONS {
            assert!(std::env::var_os(format!("MIMALLOC_{}", name.to_uppercase())).is_none());
            let got: Vec<_> = all.iter().filter(|(n, _)| n == name).map(|(_, v)| *v).collect();
            assert_eq!(got, vec![value], "{name} in {all:?}");
        }
        // mimalloc's own defaults for two it is not told about, as its options.c has them.
        let of = |name: &str| all.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
        assert_eq!((of("purge_decommits"), of("arena_purge_mult")), (Some(1), Some(1)));
        assert!(super::tuned());
    }
}
